"""A coordinator started by hand on data that makes one chunk says at its start that nothing is
held out (as `diloco run` does, with the same function), instead of an evaluation that never comes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.coordinator.held_out import SplitSizes, held_out_warning
from diloco.coordinator.server import start_coordinator


def test_one_chunk_and_nothing_held_out_is_said_with_what_to_set() -> None:
    cfg = RunConfig()
    warning = held_out_warning(SplitSizes(chunks=1, held_out=0, nbytes=20_000_000), cfg)
    assert warning is not None
    assert warning.startswith("no held-out split: the dataset made 1 chunk(s)"), warning
    assert "eval_loss" in warning and "only one data worker has work" in warning, warning
    assert "--set data.chunk_bytes=999424" in warning, warning  # 20 MB / 20 chunks, in KiB


def test_epoch_copies_are_one_chunk_of_data() -> None:
    cfg = RunConfig().with_overrides({"data.epochs": 4})
    warning = held_out_warning(SplitSizes(chunks=4, held_out=0, nbytes=4 * 100_000), cfg)
    assert warning is not None and "made 1 chunk(s)" in warning and "chunk_bytes=4096" in warning, warning


def test_no_warning_with_a_held_out_split_or_when_none_was_asked_for() -> None:
    assert held_out_warning(SplitSizes(chunks=20, held_out=1, nbytes=10**6), RunConfig()) is None
    assert held_out_warning(SplitSizes(chunks=0, held_out=0, nbytes=0), RunConfig()) is None
    none_asked = RunConfig().with_overrides({"data.eval_fraction": 0.0})
    assert held_out_warning(SplitSizes(chunks=1, held_out=0, nbytes=10**6), none_asked) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("chunk_bytes", "warned"), [(64 << 20, True), (32768, False)])
def test_the_standalone_coordinator_warns_at_start(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, chunk_bytes: int, warned: bool
) -> None:
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": chunk_bytes})
    with caplog.at_level(logging.WARNING, logger="diloco.coordinator"):
        running = start_coordinator(cfg, str(tmp_path / "run"))
        running.stop()
    said = [r.getMessage() for r in caplog.records if "no held-out split" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert "made 1 chunk(s) of data.chunk_bytes = 67108864" in said[0], said[0]
