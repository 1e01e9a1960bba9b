"""The data worker's pure work on one chunk: read, tokenize, mark document ends, pack."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diloco.data.chunks import ChunkSpec
from diloco.data.fields import check_chunk_field
from diloco.data.packing import pack_rows
from diloco.data.records import DEFAULT_MAX_RECORD_BYTES, RecordStats, iter_documents
from diloco.data.shard import token_dtype
from diloco.tokenizer import Tokenizer


@dataclass
class ProcessedChunk:
    rows: np.ndarray  # [n, seq_len + 1]
    tokens_in: int  # tokens produced (end-of-text included) before packing
    dropped_tokens: int  # tail that did not fill a last row
    stats: RecordStats
    bytes_in: int  # raw bytes read


def process_chunk(
    chunk: ChunkSpec,
    tokenizer: Tokenizer,
    seq_len: int,
    text_field: str,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> ProcessedChunk:
    stats = RecordStats()
    dtype = token_dtype(tokenizer.vocab_size)
    documents: list[np.ndarray] = []
    for segment in chunk.segments:
        for text, ends_document in iter_documents(segment, text_field, stats, max_record_bytes):
            ids = tokenizer.encode(text)
            if ends_document:
                ids.append(tokenizer.eot_id)
            # Held as arrays, not lists of ints: a whole compressed file can be one chunk.
            # fromiter refuses ids that do not fit the dtype (OverflowError).
            documents.append(np.fromiter(ids, dtype, len(ids)))
    # A misnamed text field trains nothing: the chunk fails with the fields its records do have.
    check_chunk_field(chunk.segments, stats, text_field)
    tokens_in = sum(len(d) for d in documents)
    rows, dropped = pack_rows(documents, seq_len, dtype)
    # Shuffle rows once, here, with a seed fixed by the chunk: learners then read contiguous row
    # ranges (cheap to account for exactly once) and still get well-mixed batches.
    rows = rows[np.random.default_rng(chunk.index).permutation(len(rows))]
    return ProcessedChunk(
        rows=rows, tokens_in=tokens_in, dropped_tokens=dropped, stats=stats, bytes_in=chunk.nbytes
    )
