"""`diloco run`: a whole job on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ConfigOpt, DataParallelChoice, ModelOpt, SetOpt, build_config, clear_errors
from diloco.errors import DilocoError
from diloco.local.options import LocalRunOptions
from diloco.simulate.costs import LINK_BANDWIDTH, LINK_RTT


def auto_overrides(run_dir: Path, bandwidth: str, rtt: str, learners: int) -> list[str]:
    """`diloco tune`'s recommendation from an earlier run, as `--set` assignments (printed)."""
    from diloco.simulate.costs import parse_bandwidth, parse_duration
    from diloco.simulate.tune import recommend_for_run

    try:
        tuning = recommend_for_run(
            str(run_dir),
            bandwidth_gbps=parse_bandwidth(bandwidth),
            rtt_s=parse_duration(rtt),
            learners=learners,
        )
    except (ValueError, FileNotFoundError) as e:
        raise DilocoError(f"--auto: {e}") from None
    typer.echo(f"--auto ({run_dir}, {bandwidth} at {rtt}): " + " ".join(tuning.overrides()))
    if not tuning.fits:
        typer.echo("warning: --auto: even int4 at H = 500 overloads this link; the syncs will lag", err=True)
    return tuning.overrides()


@clear_errors
def run(
    minutes: Annotated[
        float, typer.Option(help="wall-clock budget (0: until the data or token budget ends)")
    ] = LocalRunOptions.minutes,
    tokens: Annotated[
        int, typer.Option(help="token budget over all learners (0: none)")
    ] = LocalRunOptions.tokens,
    learners: Annotated[int, typer.Option(help="learner processes (M)")] = LocalRunOptions.learners,
    learner_ranks: Annotated[
        str,
        typer.Option(
            help="ranks per learner, each a torchrun group of N processes (DDP or FSDP inside); "
            "a list gives each learner its own (2,1: a 2-rank learner, then 1-rank ones)"
        ),
    ] = "1",
    data_parallel: Annotated[
        DataParallelChoice, typer.Option(help="inside a learner of several ranks: ddp, or fsdp (sharded)")
    ] = DataParallelChoice.ddp,
    data_workers: Annotated[int, typer.Option(help="data worker processes")] = LocalRunOptions.data_workers,
    workdir: Annotated[Path | None, typer.Option(help="run directory (default: ./runs/<name>)")] = None,
    name: Annotated[str | None, typer.Option(help="run name (default: run-<date>-<time>)")] = None,
    model: ModelOpt = None,
    seed: Annotated[int | None, typer.Option(help="model init and sampling seed")] = None,
    dataset: Annotated[str | None, typer.Option(help='"stdlib" (default), a directory, glob or file')] = None,
    store: Annotated[
        str | None, typer.Option(help="URI for shards and checkpoints (default: the run dir)")
    ] = None,
    inner_steps: Annotated[int | None, typer.Option(help="H: inner steps between syncs")] = None,
    quorum: Annotated[
        int | None, typer.Option(help="K: pushes a round needs (0: every live learner)")
    ] = None,
    fragments: Annotated[int | None, typer.Option(help="P: parameter fragments")] = None,
    overlap: Annotated[
        int | None, typer.Option(help="τ: inner steps between a push and applying its merge")
    ] = None,
    sync: Annotated[
        bool, typer.Option("--sync", help="synchronous DiLoCo: quorum = every learner, one fragment, τ = 0")
    ] = False,
    merge: Annotated[str | None, typer.Option(help="mean | token | rda")] = None,
    codec: Annotated[
        str | None, typer.Option(help="how deltas travel: fp32 | bf16 | int8 | int4 (then zstd)")
    ] = None,
    pull_codec: Annotated[
        str | None,
        typer.Option(help="how merged fragments come back: fp32 (whole) or bf16 | int8 | int4 steps"),
    ] = None,
    slow_learner: Annotated[
        float, typer.Option(help="make one learner FACTOR× slower (experiments)")
    ] = LocalRunOptions.slow_learner,
    chaos_interval: Annotated[
        float, typer.Option(help="SIGKILL a random process (coordinator too) every ~SECONDS and restart it")
    ] = 0.0,
    chaos_roles: Annotated[
        str,
        typer.Option(
            help="comma-separated roles chaos may kill: coordinator,data,learner,evaluator (default: the first three)"
        ),
    ] = "",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="no live progress display")] = False,
    http_port: Annotated[
        int, typer.Option(min=-1, max=65535, help="the status page's loopback port (0: a free one; -1: none)")
    ] = 0,
    metrics_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="serve Prometheus /metrics on its own port too")
    ] = None,
    tls: Annotated[
        bool, typer.Option(help="mutual TLS between the job's processes (certificates in <workdir>/tls)")
    ] = LocalRunOptions.tls,
    auto: Annotated[
        Path | None,
        typer.Option(
            help="tune H, P, τ, the codec and the chunk size (diloco tune) from this earlier run's "
            "measurements, for --link-bandwidth/--link-rtt; flags and --set still win"
        ),
    ] = None,
    link_bandwidth: Annotated[
        str, typer.Option(help="with --auto: each learner's link, e.g. 1Gbit")
    ] = LINK_BANDWIDTH,
    link_rtt: Annotated[str, typer.Option(help="with --auto: that link's round trip, e.g. 50ms")] = LINK_RTT,
    host: Annotated[
        str, typer.Option(help="the address the coordinator listens on and every process dials")
    ] = LocalRunOptions.host,
    prepare_first: Annotated[
        bool,
        typer.Option(
            "--prepare-first",
            help="make every chunk a shard before the first learner starts (on one machine the "
            "learners then have its cores to themselves; default: data workers keep a few shards ahead)",
        ),
    ] = False,
    learner_prefix: Annotated[
        str,
        typer.Option(
            help='a command each learner runs under, {i} its index: "taskset -c {i}", "ip netns exec ns{i}"'
        ),
    ] = "",
) -> None:
    """Run a whole job on this machine: coordinator, data workers and learners as processes."""
    from diloco.local.launch import default_run_config, run_local

    try:
        ranks = tuple(int(r) for r in learner_ranks.split(",") if r.strip())
    except ValueError:
        raise DilocoError(f"--learner-ranks: numbers separated by commas, not {learner_ranks!r}") from None
    roles = tuple(r.strip() for r in chaos_roles.split(",") if r.strip())
    if sync and (
        given := [
            f
            for f, v in (("--quorum", quorum), ("--fragments", fragments), ("--overlap", overlap))
            if v is not None
        ]
    ):
        raise DilocoError(f"--sync sets quorum, fragments and overlap itself: drop {', '.join(given)}")
    if auto is None and (link_bandwidth, link_rtt) != (LINK_BANDWIDTH, LINK_RTT):
        raise DilocoError("--link-bandwidth and --link-rtt describe the link for --auto: give --auto RUN too")
    # --auto's choices go over a --config file (a full dump would otherwise undo them); --set
    # and the dedicated flags still go over --auto.
    tuned = auto_overrides(auto, link_bandwidth, link_rtt, learners) if auto is not None else []
    cfg = build_config(
        default_run_config(),
        config,
        [*tuned, *(set_ or [])],
        {
            "train.seed": seed,
            "model.factory": model,
            "data.dataset": dataset,
            "data.store": store,
            "train.inner_steps": inner_steps,
            "sync.quorum": quorum,
            "sync.fragments": fragments,
            "sync.merge": merge,
            "sync.overlap_steps": overlap,
            "sync.codec": codec,
            "sync.pull_codec": pull_codec,
            # The baseline every benchmark compares with; set before validation, so H ≤ the
            # default τ is fine with --sync.
            **({"sync.quorum": 0, "sync.fragments": 1, "sync.overlap_steps": 0} if sync else {}),
        },
    )
    run_local(
        LocalRunOptions(
            config=cfg,
            minutes=minutes,
            tokens=tokens,
            learners=learners,
            learner_ranks=ranks,
            data_parallel=data_parallel.value,
            data_workers=data_workers,
            workdir=str(workdir) if workdir else None,
            name=name,
            slow_learner=slow_learner,
            chaos_interval=chaos_interval,
            chaos_roles=roles,
            http_port=None if http_port < 0 else http_port,
            metrics_port=metrics_port,
            tls=tls,
            host=host,
            learner_prefix=learner_prefix,
            prepare_first=prepare_first,
            show_progress=not no_progress,
        )
    )
