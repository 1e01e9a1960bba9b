"""Whether a run has a held-out split, and what to do when it has none: one check and one text for
the coordinator (logged at its start) and for `diloco run` (on its console).

A dataset that makes one chunk (or a few, with a small data.eval_fraction) holds nothing out: the
global model is never evaluated, and with one chunk only one data worker ever has work. Nothing
fails, so without this line the first sign is an evaluation that never comes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diloco.config import RunConfig
from diloco.coordinator.report import read_only
from diloco.corpus import is_splittable
from diloco.data.types import UNIT_ROW_GROUPS, ChunkSpec

# Chunks the suggested data.chunk_bytes aims at: at the default eval_fraction (0.05) one is held out.
SUGGESTED_CHUNKS = 20


@dataclass(frozen=True)
class SplitSizes:
    chunks: int  # epoch copies included
    held_out: int
    nbytes: int  # raw bytes of every chunk, copies included
    # The most chunks any data.chunk_bytes can make of the dataset's files: each file that is never
    # cut (.npz, an image, a compressed file) is one, a parquet file one per row group. None: no
    # such bound (a text, JSONL, CSV or .npy file is cut between records).
    most_chunks: int | None = None


def split_sizes(workdir: str | Path) -> SplitSizes:
    """The run's chunks as its ledger records them."""
    with read_only(workdir) as db:
        chunks, held_out, nbytes = db.execute(
            "SELECT COUNT(*), COUNT(*) FILTER (WHERE split = 'eval'), COALESCE(SUM(nbytes), 0) FROM chunks"
        ).fetchone()
        # Read only when the warning is due: a large dataset's specs are many rows.
        specs = [] if held_out or not chunks else [r[0] for r in db.execute("SELECT spec FROM chunks")]
    return SplitSizes(chunks, held_out, nbytes, most_chunks(ChunkSpec.from_json(s) for s in specs))


def most_chunks(chunks: Iterable[ChunkSpec]) -> int | None:
    """The most chunks these chunks' files can be cut into (SplitSizes.most_chunks)."""
    pieces: set[tuple[str, int]] = set()  # (file, row group), or (file, 0) for a file read whole
    for chunk in chunks:
        for s in chunk.segments:
            if s.unit == UNIT_ROW_GROUPS:
                pieces.update((s.uri, g) for g in range(s.start, s.end))
            elif is_splittable(s.uri):
                return None
            else:
                pieces.add((s.uri, 0))
    return len(pieces) or None


def held_out_warning(sizes: SplitSizes, cfg: RunConfig) -> str | None:
    """Why the run will never be evaluated (its chunks hold nothing out), or None. A run told to
    hold nothing out (data.eval_fraction = 0) is not warned."""
    if not sizes.chunks or sizes.held_out or cfg.data.eval_fraction <= 0:
        return None
    epochs = max(cfg.data.epochs, 1)  # with nothing held out, every chunk is copied per epoch
    chunks, dataset_bytes = max(sizes.chunks // epochs, 1), sizes.nbytes // epochs
    one = ", and only one data worker has work" if chunks == 1 else ""
    return (
        f"no held-out split: the dataset made {chunks} chunk(s) of data.chunk_bytes = {cfg.data.chunk_bytes} "
        f"and none is held out (data.eval_fraction = {cfg.data.eval_fraction}), so the global model is "
        f"never evaluated (eval_loss stays null; `diloco eval` needs --dataset){one}; "
        + remedy(dataset_bytes, sizes.most_chunks)
    )


def remedy(dataset_bytes: int, most: int | None) -> str:
    """What makes more chunks of this dataset: a smaller data.chunk_bytes only where its files can
    be cut further (two chunks are enough to hold one out)."""
    if most is None or most >= SUGGESTED_CHUNKS:
        share = dataset_bytes // SUGGESTED_CHUNKS  # in whole KiB, unless the dataset is tiny
        suggested = share // 1024 * 1024 if share >= 1024 else max(share, 1)
        return (
            "give more data, or start again in a new workdir with a smaller data.chunk_bytes "
            f"(--set data.chunk_bytes={suggested})"
        )
    if most >= 2:  # files (or row groups) read whole: at most one chunk each
        return (
            f"its files are never cut (.npz, images and compressed files are read whole, parquet "
            f"only between row groups), so they make at most {most} chunks: start again in a new "
            f"workdir with --set data.chunk_bytes={max(1, dataset_bytes // most)}, or split the "
            "data into more files"
        )
    return (
        "it is one file that is never cut (.npz, images and compressed files are read whole, "
        "parquet only between row groups), so no data.chunk_bytes makes more chunks: split the "
        f"data into several files (about {SUGGESTED_CHUNKS}, so one is held out) and start again "
        "in a new workdir"
    )


def no_eval_split_warning(workdir: str | Path, cfg: RunConfig) -> str | None:
    """held_out_warning for the run in `workdir` (its ledger must exist)."""
    return held_out_warning(split_sizes(workdir), cfg)
