"""`diloco simulate` and `diloco tune` refuse what makes no sense, or what the simulator cannot
run, in one line that names the field or flag (exit 2, no traceback), before any run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from diloco.simulate import FailureConfig, RecoveryConfig, SimConfig
from diloco.simulate.config import LinkConfig, OuterConfig, StragglerConfig
from diloco.simulate.sweep import series

runner = CliRunner()
BASE = SimConfig(chips=20_000, learners=4, hours=1.0)


def refused(args: list[str]) -> str:
    """The one-line refusal of `diloco simulate ARGS` (small and fast, should it run)."""
    result = runner.invoke(app, ["simulate", "--hours", "1", "--chips", "1000", "--learners", "2", *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # Absurd sizes: drawn up front, they crashed numpy (81 PiB) or ran until killed.
        (["--chips", "1e20"], "chips must be in [1, 1e+09]"),
        (["--chips", "1e12"], "chips must be in"),
        (["--hours", "1e9"], "expected failures per run"),
        (["--mtbi-years", "1e-12"], "raise mtbi_years"),
        (["--coordinator-mtbi-s", "1e-9"], "coordinator failures"),
        (["--hours", "nan"], "hours must be > 0"),
        (["--learners", "20000", "--chips", "1e6"], "learners (M) must be <= chips and <= 10,000"),
        (["--chips", "4", "--learners", "8"], "learners (M) must be <= chips"),
        (["--chips", "1e9", "--hours", "1e-6", "--weibull-shape", "0.5", "--slice-chips", "1"], "slices"),
        (
            ["--chips", "1", "--learners", "1", "--hours", "1e9", "--mtbi-years", "1e9", "--sync-diloco"],
            "outer steps",
        ),
        (
            ["--chips", "1", "--learners", "1", "--hours", "1e9", "--mtbi-years", "1e9", "--sensitivity"],
            "outer steps",
        ),
        # A Weibull shape of 0 divided by zero, a negative one hit a math domain error.
        (["--weibull-shape", "0"], "weibull_shape must be > 0"),
        (["--weibull-shape", "-1"], "weibull_shape must be > 0"),
        # Nonsense that ran silently.
        (["--restart-s", "-5"], "restart_s must be >= 0"),
        (["--quorum", "99"], "quorum (K = 99) must be <= learners (M = 2)"),
        (["--learners", "2,16", "--quorum", "4"], "quorum (K = 4) must be <= learners (M = 2)"),
        (["--slow-share", "2"], "slow_share must be in [0, 1]"),
        (["--slow-share", "-0.1"], "slow_share must be in [0, 1]"),
        (["--slice-chips", "0"], "slice_chips must be >= 1"),
        (["--slice-chips", "-3"], "slice_chips must be >= 1"),
        (["--params", "0"], "params must be > 0"),
        (["--params", "-1"], "params must be > 0"),
        (["--overlap", "-1"], "overlap_steps (tau) must be >= 0"),
        (["--spares", "-5"], "spares must be >= 0"),
        (["--slow-factor", "0"], "slow_factor must be >= 1"),
        (["--jitter-sigma", "-1"], "jitter_sigma must be >= 0"),
        (["--state-every-s", "-1"], "state_every_s must be >= 0"),
        (["--coordinator-mtbi-s", "-10"], "coordinator_mtbi_s must be > 0"),
        (["--reconfigure-s", "-1"], "reconfigure_s must be >= 0"),
        (["--halt-bound-s", "-1"], "halt_bound_s must be >= 0"),
        # One output at a time.
        (["--json", "--markdown"], "--markdown cannot be used with --json"),
        (["--json", "--plot", "x.png"], "--plot cannot be used with --json"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(args: list[str], says: str) -> None:
    assert says in refused(args)


def test_every_problem_in_one_line() -> None:
    line = refused(["--restart-s", "-5", "--slow-share", "2"])
    assert "restart_s" in line and "slow_share" in line


@pytest.mark.parametrize(
    ("name", "says"),
    [("plot.txt", "format 'txt' is not supported"), ("plot", "no file extension"),
     ("missing/x.png", "does not exist (it is not created)"), (".", "is a folder")],
)  # fmt: skip
def test_a_plot_path_matplotlib_cannot_write_is_refused_before_any_run(
    tmp_path: Path, name: str, says: str
) -> None:
    path = tmp_path if name == "." else tmp_path / name
    assert says in refused(["--plot", str(path)])
    assert not (tmp_path / "missing").exists()  # the folder is not made


def test_a_plot_in_an_existing_folder_is_drawn(tmp_path: Path) -> None:
    svg = tmp_path / "sim.svg"
    result = runner.invoke(
        app, ["simulate", "--hours", "1", "--chips", "1000", "--learners", "2", "--plot", str(svg)]
    )
    assert result.exit_code == 0, result.output
    assert b"<svg" in svg.read_bytes()[:400]


@pytest.mark.parametrize(
    ("text", "says"),
    [("10\n200 slice\n", "line 2: '200 slice' is not a failure"), ("-5\n", "line 1"), ("1 2 3\n", "line 1"),
     ("10 -2\n", "line 1"), ("nan\n", "line 1"), ("# none\n\n", "holds no failure"), ("", "holds no failure")],
)  # fmt: skip
def test_a_bad_trace_names_the_file_the_line_and_the_format(tmp_path: Path, text: str, says: str) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(text)
    line = refused(["--trace", str(trace)])
    assert says in line and str(trace) in line
    assert "SECONDS [UNIT]" in line


def test_a_good_trace_still_runs(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("# seconds unit\n100 1\n200 0  # the second\n")
    result = runner.invoke(app, ["simulate", "--hours", "1", "--chips", "1000", "--learners", "2", "--json",
                                 "--trace", str(trace)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["decoupled-m2"]["1000"] < 1.0


def test_a_resumed_run_is_not_calibrated(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(goodput=None, resumed_from={"tokens_trained": 100, "tokens_merged": 90})
    (run_dir / "summary.json").write_text(json.dumps(summary))
    line = refused(["--calibrate", str(run_dir)])
    assert "a resumed run" in line and "mix" in line


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        (BASE.with_(failure=FailureConfig(weibull_shape=0.0)), "weibull_shape must be > 0"),
        (BASE.with_(failure=FailureConfig(weibull_shape=float("nan"))), "weibull_shape must be > 0"),
        (BASE.with_(failure=FailureConfig(trace=(1.0, float("inf")))), "trace: every failure time"),
        (BASE.with_(chips=10**12), "chips must be in"),
        (BASE.with_(hours=float("inf")), "hours must be > 0"),
        (BASE.with_(recovery=RecoveryConfig(restart_s=-5)), "restart_s must be >= 0"),
        (BASE.with_(recovery=RecoveryConfig(rejoin_pull_s=-1)), "rejoin_pull_s must be >= 0"),
        (BASE.with_(recovery=RecoveryConfig(spares=-1)), "spares must be >= 0"),
        (BASE.with_(link=LinkConfig(params=0)), "params must be > 0"),
        (BASE.with_(link=LinkConfig(rtt_s=-1)), "rtt_s must be >= 0"),
        (BASE.with_(link=LinkConfig(bits_per_param=0)), "bits_per_param must be > 0"),
        (BASE.with_(outer=OuterConfig(quorum=5)), "quorum (K = 5) must be <= learners (M = 4)"),
        (BASE.with_(outer=OuterConfig(overlap_steps=-1)), "overlap_steps (tau) must be >= 0"),
        (BASE.with_(straggler=StragglerConfig(slow_share=1.5)), "slow_share must be in [0, 1]"),
        (BASE.with_(straggler=StragglerConfig(slow_factor=0.5)), "slow_factor must be >= 1"),
        (BASE.with_(slice_chips=0), "slice_chips must be >= 1"),
        (BASE.with_(learners=0), "learners must be >= 1"),
    ],
)
def test_the_library_refuses_with_the_fields_name(cfg: SimConfig, says: str) -> None:
    with pytest.raises(ValueError, match="must|trace") as e:
        cfg.check()
    assert says in str(e.value)


def test_the_cap_counts_expected_failures_and_the_defaults_are_far_below_it() -> None:
    day = SimConfig(chips=2_400_000, hours=24.0)
    assert 6000 < day.expected_failures < 7000
    day.check()  # the paper's largest job, a day: ~6,600 failures
    with pytest.raises(ValueError, match="expected failures"):
        replace(day, hours=24.0 * 1000).check()


def test_a_sweep_checks_every_pair_before_its_first_run() -> None:
    with pytest.raises(ValueError, match=r"quorum \(K = 3\) must be <= learners \(M = 2\)"):
        series(BASE.with_(outer=OuterConfig(quorum=3)), chips=[1000], learners=[4, 2])


def test_tune_prints_an_absurd_link_load_readably() -> None:
    result = runner.invoke(app, ["tune", "--step-s", "0.5", "--params", "1e30"])
    assert result.exit_code == 0, result.output
    assert "times the link's capacity" in result.output
    assert "0000000000%" not in result.output and "00000000.0 s" not in result.output
