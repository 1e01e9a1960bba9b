"""Train a byte-level BPE tokenizer over a dataset's own texts, for `data.tokenizer`.

The texts come through the same file listing and record readers as a run's (every format a run
reads: text, JSONL, compressed, parquet), sampled up to a byte budget spread over the files in
proportion to their size, so a large dataset is represented by all of its files, not its first.
The result always holds the end-of-text special token, and is written to the store as one
tokenizer.json; its sha256 is what every worker of a run checks at join.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from diloco import store
from diloco.corpus import resolve_dataset
from diloco.data.chunks import whole_file_segment
from diloco.data.records import DEFAULT_MAX_RECORD_BYTES, RecordStats, iter_documents
from diloco.errors import DilocoError
from diloco.tokenizer import HFTokenizer

log = logging.getLogger("diloco.tokenizer")

EOT = "<|endoftext|>"
DEFAULT_MAX_BYTES = 200_000_000
# 256 byte values (the byte-level alphabet) plus end-of-text.
MIN_VOCAB = 257


@dataclass
class TrainedTokenizer:
    uri: str
    sha256: str
    vocab_size: int
    eot_id: int
    sample_bytes: int  # characters of text the tokenizer was trained on
    files: int  # files that gave text
    stats: RecordStats = field(default_factory=RecordStats)


def default_output(store_uri: str) -> str:
    """Where `diloco tokenizer train` writes by default: <store>/tokenizer/tokenizer.json."""
    return store.join(_absolute(store_uri), "tokenizer", "tokenizer.json")


def _absolute(uri: str) -> str:
    """Local paths made absolute, so the URI printed works from any directory."""
    if "://" in uri:
        return uri
    return os.path.abspath(os.path.expanduser(uri))


@dataclass
class _Sample:
    max_bytes: int
    taken: int = 0
    files: int = 0


def sample_texts(
    files: list[str],
    sample: _Sample,
    text_field: str,
    max_record_bytes: int,
    stats: RecordStats,
) -> Iterator[str]:
    """Texts of `files`, each file contributing up to its share of `sample.max_bytes` (by size)."""
    import pyarrow as pa

    sizes = [store.size(f) for f in files]
    total = sum(sizes)
    for uri, size in zip(files, sizes, strict=True):
        if sample.taken >= sample.max_bytes:
            return
        if size == 0:
            stats.empty_files += 1
            continue
        quota = sample.max_bytes if total <= sample.max_bytes else max(1, sample.max_bytes * size // total)
        try:
            segment = whole_file_segment(uri, text_field)
        except pa.ArrowInvalid as e:
            log.warning("skipping %s: not a readable parquet file: %s", uri, e)
            stats.unreadable_files += 1
            continue
        if segment is None:
            stats.empty_files += 1
            continue
        taken_here = 0
        for text, _ in iter_documents(segment, text_field, stats, max_record_bytes):
            room = min(quota - taken_here, sample.max_bytes - sample.taken)
            piece = text[:room]
            if not taken_here:
                sample.files += 1
            taken_here += len(piece)
            sample.taken += len(piece)
            yield piece
            if taken_here >= quota or sample.taken >= sample.max_bytes:
                break


def train_tokenizer(
    dataset: str,
    vocab_size: int,
    out_uri: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    text_field: str = "text",
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> TrainedTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (end-of-text included) and write it to `out_uri`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DilocoError(
            f"--vocab must be at least {MIN_VOCAB} (256 byte values and end-of-text), got {vocab_size}"
        )
    if max_bytes < 1:
        raise DilocoError(f"--max-bytes must be at least 1, got {max_bytes}")
    files = resolve_dataset(dataset)
    stats = RecordStats()
    sample = _Sample(max_bytes)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        sample_texts(files, sample, text_field, max_record_bytes, stats), trainer=trainer
    )
    if not sample.taken:
        raise DilocoError(f"dataset {dataset!r} has no text to train a tokenizer on ({_skipped(stats)})")
    if tokenizer.token_to_id(EOT) is None:  # the trainer adds it; make sure of it
        tokenizer.add_special_tokens([EOT])

    data = tokenizer.to_str().encode("utf-8")
    uri = _absolute(out_uri)
    store.write_bytes_atomic(uri, data)
    loaded = HFTokenizer(data.decode("utf-8"))  # what every role will load from it
    log.info("trained %s on %d characters of %d files (%s)", uri, sample.taken, sample.files, _skipped(stats))
    return TrainedTokenizer(
        uri=uri,
        sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=loaded.vocab_size,
        eot_id=loaded.eot_id,
        sample_bytes=sample.taken,
        files=sample.files,
        stats=stats,
    )


def _skipped(stats: RecordStats) -> str:
    bad = {k: v for k, v in stats.as_dict().items() if v and k != "records"}
    return ", ".join(f"{k} {v}" for k, v in bad.items()) or "nothing skipped"
