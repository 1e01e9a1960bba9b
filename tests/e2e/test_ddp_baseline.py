"""The DDP baseline end to end: real gloo processes on loopback, a tiny dataset, a tiny GPT."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a directory of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.ddp_baseline import main, run_ddp  # noqa: E402
from diloco.config import RunConfig  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WORDS = [
    "def",
    "return",
    "self",
    "value",
    "import",
    "class",
    "for",
    "while",
    "if",
    "else",
    "lambda",
    "yield",
    "with",
    "as",
    "try",
]


def _write_dataset(root: Path, files: int = 8, lines: int = 1200) -> None:
    rng = random.Random(0)
    for i in range(files):
        text = "\n".join(
            "    " * rng.randint(0, 2) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            for _ in range(lines)
        )
        (root / f"doc{i}.txt").write_text(text + "\n")


def _cfg(dataset: Path) -> RunConfig:
    return RunConfig().with_overrides(
        {
            "data.dataset": str(dataset),
            "data.chunk_bytes": 32_768,
            "data.eval_fraction": 0.2,
            "model.seq_len": 32,
            "model.kwargs.n_layer": 2,
            "model.kwargs.n_head": 2,
            "model.kwargs.n_embd": 32,
            "train.batch_size": 8,
            "train.warmup_steps": 5,
            "train.lr": 3e-3,
        }
    )


def test_ddp_counts_every_gradient_byte_and_learns(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _write_dataset(data)
    workers, budget = 2, 30_000
    out = tmp_path / "ddp.json"
    result = run_ddp(_cfg(data), workers=workers, max_tokens=budget, max_seconds=60, eval_batches=4, out=out)

    tokens_per_step = workers * 8 * (32 + 1)  # rows consumed × their length (seq_len + 1)
    assert result["steps"] == math.ceil(budget / tokens_per_step)
    assert result["tokens_trained"] == result["steps"] * tokens_per_step >= budget
    # ring all-reduce of fp32 gradients: each of N ranks sends 2(N-1)/N of the model per step
    per_step = result["params"] * 4 * 2 * (workers - 1) / workers * workers
    assert result["wire_bytes"] == result["steps"] * per_step > 0
    assert result["wire_bytes_per_token"] == pytest.approx(per_step / tokens_per_step)
    # it learned: far below a uniform guess over the byte vocabulary
    assert math.isfinite(result["eval_loss"]) and result["eval_loss"] < math.log(257) - 1.0
    assert json.loads(out.read_text())["wire_bytes"] == result["wire_bytes"]


def test_ddp_cli_stops_at_the_time_limit(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _write_dataset(data, files=4)
    config = tmp_path / "run.toml"
    config.write_text(_cfg(data).to_toml())
    out = tmp_path / "ddp.json"
    # no token budget: only the clock (3 s) ends training
    main(["--config", str(config), "--workers", "2", "--tokens", "0", "--minutes", "0.05", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["mode"] == "ddp" and result["workers"] == 2
    assert result["steps"] > 0 and 3.0 <= result["wall_seconds"] < 10.0
    assert result["config"]["model"]["kwargs"]["n_embd"] == 32
    assert result["wire_bytes"] == result["steps"] * result["params"] * 4 * 2
