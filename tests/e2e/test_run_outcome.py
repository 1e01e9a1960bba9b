"""`diloco run` says why a job could not do its work and exits non-zero: a setting out of range
before anything starts, learners that all failed with each one's cause. (A finished run's workdir
given again: at the end of test_pipeline's first test, which has one.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.config import ModelConfig
from diloco.model.factory import build_model
from diloco.model.weights import save_weights
from tests.support import QUICK_END, run_cli

SMALL = ["--learners", "1", "--data-workers", "1", "--no-progress", "--no-tls", "--inner-steps", "10",
         "--set", "train.threads=1", "--set", "data.chunk_bytes=32768", "--set", "model.kwargs.n_layer=1", *QUICK_END]  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    """The `error:` line and the lines under it (each an indented cause)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    return lines[start:]


@pytest.mark.timeout(60)
def test_a_negative_learning_rate_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = run_cli(["run", "--set", "train.lr=-1", "--workdir", str(tmp_path / "run")], timeout=50)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: train.lr must be >= 0 and finite, got -1.0"]
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(150)
def test_learners_that_all_fail_end_the_run_with_their_cause(tiny_corpus: Path, tmp_path: Path) -> None:
    """Weights of another model: every learner refuses them; the run says so, with no table of zeros."""
    other = tmp_path / "other.safetensors"
    save_weights(str(other), dict(build_model(ModelConfig(kwargs={"n_layer": 2}), 257).named_parameters()))
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--dataset", str(tiny_corpus), "--workdir", str(workdir), "--minutes", "1", *SMALL,
         "--set", f"model.init_from={other}"],
        timeout=140,
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    head, *causes = error_lines(result.stderr)
    assert "merged nothing" in head and "learner-0" in head and str(workdir / "logs") in head, head
    assert len(causes) == 1 and causes[0].startswith("  learner-0: model.init_from:"), causes
    assert "does not fit this model" in causes[0], causes
    assert "Traceback" not in result.stderr and "wire bytes" not in result.stdout, result.stdout
    assert not (workdir / "summary.json").exists()
