"""The user's own model, end to end: a factory installed where the learners run trains through
`diloco run`, and a learner whose model is not the run's, or whose forward gives no loss, leaves
with one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import run_cli, tiny_coordinator

pytestmark = pytest.mark.e2e

TOY = "tests.toy_models:tiny_lm"


@pytest.mark.timeout(240)
def test_a_users_factory_trains_through_diloco_run(tiny_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--model", TOY, "--set", "model.kwargs.width=32", "--dataset", str(tiny_corpus),
         "--minutes", "1", "--tokens", "300000", "--learners", "2", "--data-workers", "1",
         "--inner-steps", "20", "--workdir", str(workdir), "--no-progress",
         "--set", "data.chunk_bytes=65536", "--set", "train.lr=0.01", "--set", "eval.final_batches=4"],
        timeout=200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["config"]["model"]["factory"] == TOY and summary["config"]["model"]["kwargs"] == {
        "width": 32
    }
    assert summary["params"] == 257 * 32 + 32 * 32 + 32 + 32 * 257 + 257
    assert summary["eval_loss"] < summary["first_loss"] - 0.5, summary
    # the model's own metric, averaged over the held-out rows like the loss
    assert 0.1 < summary["eval_metrics"]["accuracy"] < 1.0, summary["eval_metrics"]
    # ...and, while it trained, the learners' own (heartbeats: diloco status and the live view)
    assert 0.1 < summary["train_metrics"]["accuracy"] < 1.0, summary["train_metrics"]
    assert summary["sample"].startswith("def ")  # it has logits(), so it writes a sample


@pytest.mark.timeout(120)
def test_a_learner_whose_model_is_not_the_runs_is_refused(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path / "coord", {"model.factory": TOY, "model.kwargs": {}}) as (
        running,
        _,
        _,
    ):
        address = f"127.0.0.1:{running.port}"
        # Another version of the user's package on this machine builds a wider model.
        result = run_cli(
            ["compute", "--coordinator", address, "--threads", "1"], timeout=90, env={"TOY_LM_SCALE": "2"}
        )
    assert result.returncode != 0
    refusal = [line for line in result.stderr.splitlines() if "is not the run's" in line]
    assert refusal and "shapes differ: ['embed.weight (257, 32) vs (257, 16)'" in refusal[-1], result.stderr[
        -2000:
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_a_forward_without_a_loss_is_refused_at_the_first_step(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(
        tiny_corpus, tmp_path / "coord", {"model.factory": "tests.toy_models:no_loss", "model.kwargs": {}}
    ) as (running, _, _):
        result = run_cli(
            ["compute", "--coordinator", f"127.0.0.1:{running.port}", "--threads", "1"], timeout=90
        )
    assert result.returncode != 0
    assert "model.factory tests.toy_models:no_loss: forward returned a tensor of shape" in result.stderr, (
        result.stderr[-2000:]
    )
    assert "Traceback" not in result.stderr
