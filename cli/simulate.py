"""`diloco simulate`: goodput of DP, elastic DP and (Decoupled) DiLoCo at a given scale.

It parses options into a diloco.simulate.SimConfig and calls the library's sweep and report.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from cli.common import clear_errors
from diloco.errors import DilocoError
from diloco.simulate.costs import LINK_BANDWIDTH, LINK_RTT

PAPER_CHIPS = "150000,300000,600000,1200000,2400000"


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DilocoError(f"{what}: a comma-separated list of numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DilocoError(f"{what}: give at least one number >= 1, got {text!r}")
    return values


@clear_errors
def simulate(
    chips: Annotated[str, typer.Option(help="chip counts, comma-separated")] = PAPER_CHIPS,
    learners: Annotated[str, typer.Option(help="M: DiLoCo learners, comma-separated")] = "2,4,8,16",
    mtbi_years: Annotated[float, typer.Option(help="mean time between interruptions per chip, years")] = 1.0,
    hours: Annotated[float, typer.Option(help="simulated wall time")] = 24.0,
    seed: Annotated[int, typer.Option(help="seed of every random draw")] = 0,
    slice_chips: Annotated[int, typer.Option(help="chips that fail together (and elastic DP drops)")] = 256,
    weibull_shape: Annotated[
        float | None, typer.Option(help="Weibull shape per slice (default: Poisson)")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="measured failures: a file of 'SECONDS [UNIT]' lines")
    ] = None,
    restart_s: Annotated[
        float, typer.Option(help="failure -> program running again (spare, restart)")
    ] = 30.0,
    startup_s: Annotated[float, typer.Option(help="software start-up after a restart, pull aside")] = 0.0,
    reconfigure_s: Annotated[float, typer.Option(help="elastic DP's pause per failure")] = 10.0,
    repair_s: Annotated[float, typer.Option(help="a failed slice is back after this long")] = 3600.0,
    spares: Annotated[int, typer.Option(help="hot spare slices (-1: always one at hand)")] = -1,
    state_every_s: Annotated[float, typer.Option(help="kept state every SECONDS (0: every step)")] = 0.0,
    state_lost: Annotated[
        bool, typer.Option(help="a failed learner loses its state (falls back to pushes)")
    ] = False,
    step_s: Annotated[float, typer.Option(help="one inner (or DP) step, seconds")] = 2.0,
    dp_exposed_comm_s: Annotated[
        float, typer.Option(help="DP all-reduce per step not hidden by compute")
    ] = 0.0,
    params: Annotated[float, typer.Option(help="model parameters")] = 12e9,
    codec: Annotated[str, typer.Option(help="fp32 | bf16 | int8 | int4")] = "int4",
    bandwidth: Annotated[
        str, typer.Option(help="each learner's link to the syncer, e.g. 5Gbit, 100Mbit")
    ] = "5Gbit",
    rtt: Annotated[str, typer.Option(help="that link's round trip, e.g. 50ms")] = "50ms",
    quorum: Annotated[int | None, typer.Option(help="K: pushes a round needs (default: a run's)")] = None,
    fragments: Annotated[int | None, typer.Option(help="P: parameter fragments (default: a run's)")] = None,
    inner_steps: Annotated[
        int | None, typer.Option(help="H: inner steps between syncs of a fragment (default: a run's)")
    ] = None,
    overlap: Annotated[
        int | None, typer.Option(help="tau: steps between a push and applying its merge (default: a run's)")
    ] = None,
    halt_bound_s: Annotated[
        float | None,
        typer.Option(
            help="learners step on this long while merging halts (default: a run's sync.max_unreachable_s)"
        ),
    ] = None,
    coordinator_mtbi_s: Annotated[
        float | None, typer.Option(help="coordinator failures: mean seconds apart")
    ] = None,
    coordinator_restart_s: Annotated[float, typer.Option(help="coordinator back after a failure")] = 30.0,
    jitter_sigma: Annotated[
        float, typer.Option(help="per-step log-normal noise of a slice's step time")
    ] = 0.0,
    slow_share: Annotated[float, typer.Option(help="share of slices/learners persistently slow")] = 0.0,
    slow_factor: Annotated[float, typer.Option(help="how much slower they are")] = 1.0,
    sync_diloco: Annotated[
        bool, typer.Option("--sync-diloco", help="add synchronous DiLoCo (sync-diloco-m<M>)")
    ] = False,
    calibrate: Annotated[
        Path | None, typer.Option(help="a finished `diloco run` workdir to measure costs from")
    ] = None,
    sensitivity: Annotated[
        bool, typer.Option(help="also: quorum, H, codec, link moved one at a time")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print {mode: {chips: goodput}} as one JSON object")
    ] = False,
    as_markdown: Annotated[
        bool, typer.Option("--markdown", help="print markdown tables (for a README)")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option(help="also draw the goodput curves into this PNG (not with --json)")
    ] = None,
) -> None:
    """Goodput at scale: DP, elastic DP and DiLoCo learners under chip failures (a simpy model)."""
    if as_json and plot is not None:  # --json prints one object and returns: the plot was never drawn
        raise DilocoError("--plot cannot be used with --json (JSON is printed alone): drop one")
    if as_json and as_markdown:  # one output format: JSON used to win silently
        raise DilocoError("--markdown cannot be used with --json (each is a whole output): drop one")
    from diloco.simulate import config as c
    from diloco.simulate import report, sweep
    from diloco.simulate.costs import parse_bandwidth, parse_duration
    from diloco.simulate.failures import read_trace

    try:
        if plot is not None:  # before the sweep: a bad path used to fail after every run
            report.check_plot_path(plot)
        failure_trace, trace_units = read_trace(trace) if trace else (None, None)
        base = c.SimConfig(
            hours=hours, seed=seed, slice_chips=slice_chips, step_s=step_s, dp_exposed_comm_s=dp_exposed_comm_s,
            failure=c.FailureConfig(mtbi_years=mtbi_years, weibull_shape=weibull_shape, trace=failure_trace,
                                    trace_units=trace_units, coordinator_mtbi_s=coordinator_mtbi_s),
            recovery=c.RecoveryConfig(restart_s=restart_s, startup_s=startup_s, reconfigure_s=reconfigure_s,
                                      repair_s=repair_s, spares=None if spares == -1 else spares,
                                      state_every_s=state_every_s, state_survives=not state_lost,
                                      coordinator_restart_s=coordinator_restart_s),
            link=c.LinkConfig(params=params, codec=codec, bandwidth_gbps=parse_bandwidth(bandwidth),
                              rtt_s=parse_duration(rtt)),
            outer=c.OuterConfig(**{k: v for k, v in {
                "inner_steps": inner_steps, "fragments": fragments, "overlap_steps": overlap, "quorum": quorum,
                "halt_bound_s": halt_bound_s}.items() if v is not None}),
            straggler=c.StragglerConfig(jitter_sigma=jitter_sigma, slow_share=slow_share, slow_factor=slow_factor),
        )  # fmt: skip
        chip_counts, ms = _ints(chips, "--chips"), _ints(learners, "--learners")
        cal = replay = None
        if calibrate is not None:
            from diloco.simulate.calibrate import read_calibration, replay_config, scaled_config
            from diloco.simulate.engine import simulate as run_one

            cal = read_calibration(calibrate)
            base = scaled_config(cal, base)
            replay = run_one(replay_config(cal), "decoupled")
        results = sweep.series(base, chips=chip_counts, learners=ms, sync_diloco=sync_diloco)
        largest = base.with_(chips=max(chip_counts), learners=max(ms))
        sens = sweep.sensitivity(largest) if sensitivity else None
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise DilocoError(str(e)) from None
    if as_json:
        typer.echo(json.dumps(sweep.goodput_json(results), sort_keys=False))
        return
    from rich.console import Console

    console = Console(width=160)
    if cal is not None and replay is not None:
        from diloco.simulate.calibrate import SCALED_ASSUMPTIONS

        console.print("[bold]measured[/bold] (" + str(calibrate) + ")")
        for line in report.calibration_lines(cal):
            console.print(f"  {line}")
        console.print(
            f"  this run replayed from its own kills: goodput {replay.goodput:.1%} (measured {cal.goodput:.1%})"
        )
        console.print("[bold]carried to the large job[/bold]: " + "; ".join(SCALED_ASSUMPTIONS))
    if as_markdown:
        typer.echo(report.markdown(results))
        if sens is not None:
            typer.echo("")
            typer.echo(report.sensitivity_markdown(sens, largest))
    else:
        console.print(report.goodput_table(results))
        console.print(report.detail_table(results))
        if sens is not None:
            console.print(report.sensitivity_markdown(sens, largest))
    console.print("[bold]assumptions[/bold] (not measured here):")
    for line in report.assumptions(replace(base, chips=max(chip_counts))):
        console.print(f"  - {line}")
    if plot is None:  # a file only when asked: the command is run from anywhere, a repository too
        return
    try:
        path = report.plot(results, plot, title=f"MTBI {mtbi_years:g} y/chip, {hours:g} h, seed {seed}")
    except (ImportError, ValueError, OSError) as e:  # e.g. a folder without write permission
        raise DilocoError(str(e)) from None
    console.print(f"plot: {path}")


@clear_errors
def tune(
    calibrate: Annotated[
        Path | None, typer.Option(help="a finished `diloco run` workdir: its step time, model")
    ] = None,
    bandwidth: Annotated[
        str, typer.Option(help="each learner's link to the syncer, e.g. 1Gbit")
    ] = LINK_BANDWIDTH,
    rtt: Annotated[str, typer.Option(help="that link's round trip, e.g. 50ms")] = LINK_RTT,
    learners: Annotated[int, typer.Option(help="M: learners the measured tokens/s was shared by")] = 2,
    step_s: Annotated[float | None, typer.Option(help="seconds per inner step (default: measured)")] = None,
    params: Annotated[float | None, typer.Option(help="model parameters (default: measured)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the recommendation as JSON")] = False,
) -> None:
    """Recommend H, fragments, overlap, codec and chunk size for a measured step time and a link."""
    from diloco.simulate.config import LinkConfig
    from diloco.simulate.costs import parse_bandwidth, parse_duration
    from diloco.simulate.tune import check_inputs, recommend, recommend_for_run

    try:
        gbps, rtt_s = parse_bandwidth(bandwidth), parse_duration(rtt)
        # Every flag at once, before a run directory is read: one line names each bad one.
        check_inputs(step_s=step_s, params=params, bandwidth_gbps=gbps, rtt_s=rtt_s, learners=learners)
        if calibrate is not None:
            tuning = recommend_for_run(
                str(calibrate),
                bandwidth_gbps=gbps,
                rtt_s=rtt_s,
                learners=learners,
                step_s=step_s,
                params=params,
            )
            step, size = tuning.step_s, tuning.params
        elif step_s is not None and params is not None:
            step, size = step_s, params
            tuning = recommend(step_s=step, link=LinkConfig(params=size, bandwidth_gbps=gbps, rtt_s=rtt_s))
        else:
            raise DilocoError("give --calibrate RUN_DIR, or both --step-s and --params")
    except (ValueError, FileNotFoundError) as e:
        raise DilocoError(str(e)) from None
    if as_json:
        out = {"overrides": tuning.overrides(), "fits": tuning.fits,
               "choices": [c.__dict__ for c in tuning.choices]}  # fmt: skip
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    model = f"{size / 1e9:g} B" if size >= 1e9 else f"{size / 1e6:g} M"
    table = Table(title=f"{model} params, {step * 1e3:.0f} ms a step, {bandwidth} at {rtt}, M = {learners}")
    for column in ("setting", "default", "recommended", "what it costs and buys"):
        table.add_column(column, overflow="fold")
    for c in tuning.choices:
        table.add_row(c.name, c.default, c.value, c.why)
    console = Console(width=160)
    console.print(table)
    # One line however long: it is copied into a shell.
    console.print("diloco run " + " ".join(f"--set {o}" for o in tuning.overrides()), soft_wrap=True)
