"""`diloco tune`: the recommendation follows the link, and a fast link keeps the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.simulate.config import LinkConfig
from diloco.simulate.tune import link_load, recommend, recommend_for_run


def test_a_fast_link_keeps_the_defaults() -> None:
    t = recommend(step_s=0.2, link=LinkConfig(params=1e6, bandwidth_gbps=1.0, rtt_s=0.05))
    run = RunConfig()  # a run's own defaults, which the simulator's outer loop takes
    assert (t.inner_steps, t.fragments, t.overlap_steps, t.codec, t.fits) == (
        run.train.inner_steps,
        run.sync.fragments,
        run.sync.overlap_steps,
        run.sync.codec,
        True,
    )


def test_a_slower_link_trades_the_codec_first_then_h() -> None:
    link = LinkConfig(params=12e9, bandwidth_gbps=5.0, rtt_s=0.05)
    at_5 = recommend(step_s=2.0, link=link)
    assert (at_5.inner_steps, at_5.codec) == (50, "bf16")
    at_1 = recommend(step_s=2.0, link=LinkConfig(params=12e9, bandwidth_gbps=1.0, rtt_s=0.05))
    assert (at_1.inner_steps, at_1.codec) == (100, "int4")
    for t in (at_5, at_1):
        assert link_load(LinkConfig(params=12e9, bandwidth_gbps=5.0 if t is at_5 else 1.0, codec=t.codec),
                         t.inner_steps, 2.0) <= 0.4  # fmt: skip
        assert RunConfig().sync.overlap_steps <= t.overlap_steps <= t.inner_steps // t.fragments
    hopeless = recommend(step_s=0.5, link=LinkConfig(params=70e9, bandwidth_gbps=0.1))
    assert not hopeless.fits and any(c.name == "warning" for c in hopeless.choices)


def test_chunks_keep_their_size_unless_leases_come_every_few_seconds(run_dir: Path) -> None:
    def chunk(tokens_per_s: float, chunk_bytes: int = 262_144) -> int | None:
        return recommend(step_s=0.2, link=LinkConfig(params=1e6), tokens_per_s=tokens_per_s,
                         tokens_per_chunk=250_000.0, chunk_bytes=chunk_bytes).chunk_bytes  # fmt: skip

    assert chunk(5000.0) == 262_144  # 50 s a chunk: kept (larger ones only make batches less mixed)
    assert chunk(25_000.0) == 262_144  # exactly 10 s
    assert chunk(125_000.0) == 2 << 20  # 2 s a chunk: 1 MiB lasts 8 s, 2 MiB 16 s
    assert chunk(50_000.0, 300_000) == 1 << 20  # 5 s: the next powers of two, 512 KiB at 8.7 s, then 1 MiB
    t = recommend(step_s=0.2, link=LinkConfig(params=1e6), tokens_per_s=5000.0, tokens_per_chunk=250_000.0,
                  chunk_bytes=262_144)  # fmt: skip
    assert "data.chunk_bytes=262144" in t.overrides()
    result = CliRunner().invoke(app, ["tune", "--calibrate", str(run_dir), "--bandwidth", "10Mbit", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert any(o.startswith("sync.codec=") for o in out["overrides"])
    missing = CliRunner().invoke(app, ["tune", "--bandwidth", "1Gbit"])
    assert missing.exit_code == 2 and "--calibrate" in missing.output


def test_diloco_run_auto_takes_the_recommendation_and_flags_still_win(run_dir: Path, tmp_path: Path) -> None:
    """`diloco run --auto RUN_DIR`: the tuned settings go over a --config file (a whole dump of a
    config included, which would otherwise undo every one of them) and under the user's own
    flags and --set, as `diloco run` stacks them."""
    from cli.common import build_config
    from cli.local import auto_overrides
    from diloco.local.launch import default_run_config

    slow = auto_overrides(run_dir, "10Mbit", "50ms", 2)
    tuned = recommend_for_run(str(run_dir), bandwidth_gbps=0.01, rtt_s=0.05, learners=2)
    assert slow == tuned.overrides()
    dump = tmp_path / "run.toml"
    dump.write_text(default_run_config().to_toml())
    base = build_config(default_run_config(), dump, slow, {})
    assert base.sync.codec == tuned.codec and base.train.inner_steps == tuned.inner_steps
    assert base.sync.fragments == tuned.fragments
    mine = build_config(default_run_config(), dump, [*slow, "sync.codec=fp32"], {"train.inner_steps": 20})
    assert (mine.sync.codec, mine.train.inner_steps, mine.sync.fragments) == ("fp32", 20, tuned.fragments)
    with pytest.raises(DilocoError, match="--auto"):
        auto_overrides(run_dir.parent / "nothing", "1Gbit", "50ms", 2)
