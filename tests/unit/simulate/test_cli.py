"""`diloco simulate`: the JSON interface scripts rely on, the table and plot, --calibrate."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def test_json_maps_each_mode_to_goodput_by_chip_count() -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--chips",
            "150000,300000",
            "--mtbi-years",
            "1",
            "--learners",
            "2,4",
            "--json",
            "--hours",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert list(data) == ["dp", "elastic-dp", "decoupled-m2", "decoupled-m4"]
    for row in data.values():
        assert list(row) == ["150000", "300000"]
        assert all(0.0 <= g <= 1.0 for g in row.values())


def test_the_table_the_assumptions_and_the_plot(tmp_path: Path, run_dir: Path) -> None:
    png = tmp_path / "sim.png"  # in a folder that exists: --plot does not make one
    result = runner.invoke(app, [
        "simulate", "--chips", "100000", "--learners", "4", "--hours", "1", "--sync-diloco",
        "--calibrate", str(run_dir), "--plot", str(png), "--bandwidth", "1Gbit", "--rtt", "20ms",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    for text in ("goodput", "sync-diloco-m4", "assumptions", "replayed", "1 Gbit/s"):
        assert text in result.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_clear_line() -> None:
    result = runner.invoke(app, ["simulate", "--chips", "lots", "--json"])
    assert result.exit_code == 2
    assert "--chips" in result.output
    result = runner.invoke(app, ["simulate", "--bandwidth", "fast", "--json"])
    assert result.exit_code == 2 and "bandwidth" in result.output
