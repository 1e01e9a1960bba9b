"""Whether a run has a held-out split, and what to do when it has none: one check and one text for
the coordinator (logged at its start) and for `diloco run` (on its console).

A dataset that makes one chunk (or a few, with a small data.eval_fraction) holds nothing out: the
global model is never evaluated, and with one chunk only one data worker ever has work. Nothing
fails, so without this line the first sign is an evaluation that never comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diloco.config import RunConfig
from diloco.coordinator.report import read_only

# Chunks the suggested data.chunk_bytes aims at: at the default eval_fraction (0.05) one is held out.
SUGGESTED_CHUNKS = 20
MIN_SUGGESTED_BYTES = 4096


@dataclass(frozen=True)
class SplitSizes:
    chunks: int  # epoch copies included
    held_out: int
    nbytes: int  # raw bytes of every chunk, copies included


def split_sizes(workdir: str | Path) -> SplitSizes:
    """The run's chunks as its ledger records them."""
    with read_only(workdir) as db:
        chunks, held_out, nbytes = db.execute(
            "SELECT COUNT(*), COUNT(*) FILTER (WHERE split = 'eval'), COALESCE(SUM(nbytes), 0) FROM chunks"
        ).fetchone()
    return SplitSizes(chunks, held_out, nbytes)


def held_out_warning(sizes: SplitSizes, cfg: RunConfig) -> str | None:
    """Why the run will never be evaluated (its chunks hold nothing out), or None. A run told to
    hold nothing out (data.eval_fraction = 0) is not warned."""
    if not sizes.chunks or sizes.held_out or cfg.data.eval_fraction <= 0:
        return None
    epochs = max(cfg.data.epochs, 1)  # with nothing held out, every chunk is copied per epoch
    chunks, dataset_bytes = max(sizes.chunks // epochs, 1), sizes.nbytes // epochs
    suggested = max(MIN_SUGGESTED_BYTES, dataset_bytes // SUGGESTED_CHUNKS // 1024 * 1024)
    one = ", and only one data worker has work" if chunks == 1 else ""
    return (
        f"no held-out split: the dataset made {chunks} chunk(s) of data.chunk_bytes = {cfg.data.chunk_bytes} "
        f"and none is held out (data.eval_fraction = {cfg.data.eval_fraction}), so the global model is "
        f"never evaluated (eval_loss stays null; `diloco eval` needs --dataset){one}; give more data, or "
        f"start again in a new workdir with a smaller data.chunk_bytes (--set data.chunk_bytes={suggested})"
    )


def no_eval_split_warning(workdir: str | Path, cfg: RunConfig) -> str | None:
    """held_out_warning for the run in `workdir` (its ledger must exist)."""
    return held_out_warning(split_sizes(workdir), cfg)
