"""The device check prepared for a session lent a GPU (benchmarks/gpu_check.py) runs its code paths
here, on the CPU, so that it has not rotted by the time a GPU is there to run it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_check import main


def test_the_gpu_check_times_the_learners_own_step_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    report = main(["--device", "cpu", "--sizes", "tiny", "--compile", "off", "--warmup", "1",
                   "--steps", "2", "--run-tokens", "0", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    (row,) = report["steps"]
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["params"] > 0 and row["ms_per_step"] > 0
    assert row["mfu"] == 0.0 and report["peak_bf16"] == 0.0  # no known peak on a CPU: unknown, not a guess
    assert row["last_loss"] > 0
