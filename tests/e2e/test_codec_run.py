"""A run whose deltas travel quantized (int8 both ways) under a token budget and a quorum of two:
it ends at its budget like an fp32 run. Every push a learner makes carries the run's codec, the
empty ones too (a round's "nothing from me", the rows handed back at the end): labelled fp32, the
coordinator refused them, and a quorum-2 round waited for the refused learner until the wall clock
ran out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import QUICK_END, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_an_int8_run_with_a_quorum_of_two_ends_at_its_budget(small_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    budget = 120_000
    result = run_cli(
        ["run", "--dataset", str(small_corpus), "--workdir", str(workdir), "--tokens", str(budget),
         "--minutes", "2", "--learners", "2", "--data-workers", "1", "--codec", "int8", "--pull-codec", "int8",
         "--quorum", "2", "--inner-steps", "10", "--no-progress", "--no-tls", "--set", "model.kwargs.n_layer=1",
         "--set", "data.chunk_bytes=65536", "--set", "eval.every_s=0", *QUICK_END],
        timeout=220,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    logs = "".join(p.read_text(errors="replace") for p in (workdir / "logs").glob("learner-*.log"))
    assert "refused as malformed" not in logs, [line for line in logs.splitlines() if "malformed" in line][:3]
    assert summary["tokens_merged"] >= budget, summary["tokens_merged"]
    assert summary["audit_ok"], summary["audit_violations"]
