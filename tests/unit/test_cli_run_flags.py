"""`diloco run` flags that contradict each other are refused in one line before anything starts:
--sync sets the round itself (a --fragments beside it was dropped in silence), and the link flags
mean something only with --auto."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--sync", "--fragments", "4"],
            "--sync sets quorum, fragments and overlap itself: drop --fragments",
        ),
        (["--sync", "--quorum", "1", "--overlap", "2"], "drop --quorum, --overlap"),
        (["--link-rtt", "10ms"], "give --auto RUN too"),
        (["--chaos-interval", "-3"], "--chaos-interval must be >= 0"),
    ],
)
def test_contradicting_run_flags_are_one_line(args: list[str], said: str, tmp_path) -> None:  # noqa: ANN001
    result = CliRunner().invoke(app, ["run", "--workdir", str(tmp_path / "w"), *args])
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "w").exists()  # refused before the workdir is made
