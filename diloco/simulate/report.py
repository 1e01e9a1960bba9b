"""What a sweep shows: tables (rich, or markdown for the README), the assumptions beside them,
and a PNG of goodput over chip counts (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.simulate.calibrate import Calibration
from diloco.simulate.config import SimConfig
from diloco.simulate.costs import bits_per_param, failure_rate_per_s, sync_times
from diloco.simulate.engine import Result
from diloco.simulate.sweep import Variant


def chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def assumptions(cfg: SimConfig) -> list[str]:
    """Every input of the run that this machine did not measure, in words."""
    f, r, link, o = cfg.failure, cfg.recovery, cfg.link, cfg.outer
    sync = sync_times(link, o, cfg.step_s)
    process = f"Weibull k = {f.weibull_shape:g} per slice" if f.weibull_shape else "Poisson"
    return [
        f"failures: {f.mtbi_years:g} year(s) MTBI per chip ({process}; the Decoupled DiLoCo paper's setting; "
        f"Llama 3 saw ~5.2 GPU-years), each hitting a uniformly random slice of {cfg.slice_chips} chips",
        f"{24 * 3600 * failure_rate_per_s(cfg.with_(chips=1_000_000)):.0f} failures a day per million chips; "
        f"{cfg.hours:g} h simulated, seed {cfg.seed}",
        f"restart after a failure {r.restart_s:g} s + start-up {r.startup_s:g} s (hot spare, state from "
        f"in-memory replicas); a failure during a restart starts it again",
        f"elastic DP: {r.reconfigure_s:g} s pause per failure; a slice is back after {r.repair_s:g} s and "
        "rejoins at the next reconfiguration",
        "state kept "
        + (f"every {r.state_every_s:g} s" if r.state_every_s else "every step")
        + ("" if r.state_survives else "; a learner's is lost with it (falls back to its last pushes)"),
        f"step {cfg.step_s:g} s, {cfg.step_efficiency:.1%} of it in steps; DP's exposed all-reduce "
        f"{cfg.dp_exposed_comm_s:g} s/step",
        f"model {link.params / 1e9:g} B params, {link.codec} ({bits_per_param(link):.2f} bits/param) over "
        f"{link.bandwidth_gbps:g} Gbit/s, RTT {link.rtt_s * 1e3:g} ms: fragment push {sync.push_s:.1f} s, "
        f"rejoin pull {sync.full_pull_s:.1f} s, sync-DiLoCo outer step {sync.sync_blocking_s:.1f} s",
        f"H = {o.inner_steps}, P = {o.fragments}, tau = {o.overlap_steps}, K = {o.quorum}; learners step on "
        f"for {o.halt_bound_s:g} s while merging is halted",
        "coordinator: "
        + (
            f"fails every {f.coordinator_mtbi_s:g} s, restarts in {r.coordinator_restart_s:g} s"
            if f.coordinator_mtbi_s
            else "never fails"
        ),  # fmt: skip
        "spares: " + ("always one at hand" if r.spares is None else f"{r.spares} hot spare slice(s)"),
    ]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def goodput_table(results: dict[str, dict[int, Result]]) -> Any:
    from rich.table import Table

    chips = sorted({n for row in results.values() for n in row})
    table = Table(title="goodput (useful chip-time / allocated chip-time)")
    table.add_column("mode")
    for n in chips:
        table.add_column(chips_label(n), justify="right")
    for key, row in results.items():
        table.add_row(key, *(_pct(row[n].goodput) if n in row else "" for n in chips))
    return table


def detail_table(results: dict[str, dict[int, Result]]) -> Any:
    from rich.table import Table

    table = Table(title="uptime (>= 1 program steps) / wasted work / failures")
    table.add_column("mode")
    chips = sorted({n for row in results.values() for n in row})
    for n in chips:
        table.add_column(chips_label(n), justify="right")
    for key, row in results.items():
        cells = [f"{_pct(row[n].uptime)} / {_pct(row[n].wasted)} / {row[n].failures}" if n in row else ""
                 for n in chips]  # fmt: skip
        table.add_row(key, *cells)
    return table


def markdown(results: dict[str, dict[int, Result]]) -> str:
    chips = sorted({n for row in results.values() for n in row})
    lines = ["| mode | " + " | ".join(chips_label(n) for n in chips) + " |",
             "|---|" + "---:|" * len(chips)]  # fmt: skip
    for key, row in results.items():
        lines.append(
            f"| {key} | " + " | ".join(_pct(row[n].goodput) if n in row else "" for n in chips) + " |"
        )
    return "\n".join(lines)


def sensitivity_markdown(rows: list[Variant], base: SimConfig) -> str:
    lines = [
        f"| {chips_label(base.chips)} chips, M = {base.m} | Decoupled goodput | merge halted | H effective "
        "| fragment round trip | sync DiLoCo goodput | its outer step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in rows:
        d, s = v.decoupled, v.sync_diloco
        lines.append(
            f"| {v.name} | {_pct(d.goodput)} | {_pct(d.merge_halted)} | {d.effective_h:g} "
            f"| {d.sync['round_trip_s']:.1f} s | {_pct(s.goodput)} | {s.sync['sync_blocking_s']:.1f} s |"
        )
    return "\n".join(lines)


def calibration_lines(cal: Calibration) -> list[str]:
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in cal.restart_phases_s.items() if k != "total")
    return [
        f"run {cal.run_dir}: {cal.learners} learners, {cal.wall_s:.0f} s wall, goodput {_pct(cal.goodput)} "
        f"({_pct(cal.goodput_after_start)} after the job's {cal.job_startup_s:.1f} s start-up)",
        f"kills: {cal.kills or 'none'}; restart to first step {cal.restart_total_s:.2f} s ({phases or 'no restarts'})",
        f"work lost per kill {cal.lost_per_kill_s:.2f} s (local state every {cal.state_every_s:g} s)",
        f"step {cal.step_s * 1e3:.0f} ms, {_pct(cal.step_efficiency)} of a learner's life in steps; "
        f"wind-down {cal.wind_down_s:.1f} s",
        f"push {cal.push_bytes / 1e6:.2f} MB and pull {cal.pull_bytes / 1e6:.2f} MB per fragment "
        f"({cal.bits_per_param:.2f} bits/param, {cal.codec}); merge {cal.merge_s * 1e3:.1f} ms",
        f"coordinator kills {len(cal.coordinator_kills)}, back in {cal.coordinator_restart_s:.1f} s",
    ]


def check_plot_path(path: Path) -> None:
    """Refuse, before any run, a plot file matplotlib cannot write: a format it does not know
    (savefig raised a traceback at the end of the sweep) or a folder that is not there (it used to
    be created, parents and all: a typo made a tree the user never asked for)."""
    if path.is_dir():
        raise ValueError(f"--plot {path} is a folder: give a file name in it, e.g. {path / 'goodput.png'}")
    formats = _plot_formats()
    kind = path.suffix.lstrip(".").lower()
    if kind not in formats:
        raise ValueError(
            f"--plot {path}: " + (f"format {kind!r} is not supported" if kind else "no file extension")
            + f"; end the name in one of .{', .'.join(sorted(formats))}"
        )  # fmt: skip
    if not path.parent.is_dir():
        raise ValueError(
            f"--plot {path}: the folder {path.parent} does not exist (it is not created): make it first"
        )


def _plot_formats() -> set[str]:
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'diloco[simulate]'") from None
    return set(FigureCanvasBase.get_supported_filetypes())


def plot(results: dict[str, dict[int, Result]], path: Path, *, title: str = "") -> Path:
    """goodput over chip counts, one line per mode, to a PNG (or any format check_plot_path allows)."""
    check_plot_path(path)
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'diloco[simulate]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, row in results.items():
        chips = sorted(row)
        ax.plot(chips, [100 * row[n].goodput for n in chips], marker="o", label=key)
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "goodput over chip counts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
