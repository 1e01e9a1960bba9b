"""The worker roles, one command each: coordinator, data, compute, evaluator (and the warm spare)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.common import (
    AllowModelOpt,
    AllowPreprocessOpt,
    ConfigOpt,
    ConnectOpt,
    CoordinatorOpt,
    DataParallelChoice,
    MetricsPortOpt,
    ModelOpt,
    SetOpt,
    WorkerIdOpt,
    build_config,
    clear_errors,
    error_line,
    stop_on_signals,
)
from diloco.config import RunConfig
from diloco.logs import setup_logging


@clear_errors
def coordinator(
    workdir: Annotated[Path, typer.Option(help="state dir: ledger, checkpoints, shards (unless --store)")],
    dataset: Annotated[
        str | None, typer.Option(help='"stdlib", a directory, glob or file (local or s3://)')
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="URI where shards and checkpoints go (default: the workdir)")
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on (0: any free port)")] = 0,
    metrics_port: MetricsPortOpt = None,
    http_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="serve the status page here (0: any free port)")
    ] = None,
    http_host: Annotated[str, typer.Option(help="address the page and /metrics listen on")] = "127.0.0.1",
) -> None:
    """Serve membership, leases, the syncer and status over gRPC (and, asked, /metrics and a page)."""
    from diloco.coordinator.server import ObservePorts, serve

    setup_logging("coordinator")
    cfg = build_config(
        RunConfig(), config, set_, {"data.dataset": dataset, "data.store": store, "model.factory": model}
    )
    serve(cfg, str(workdir), host, port, ObservePorts(metrics_port, http_port, http_host))


@clear_errors
def data(
    coordinator: CoordinatorOpt,
    connect_timeout: ConnectOpt = 60.0,
    worker_id: WorkerIdOpt = None,
    metrics_port: MetricsPortOpt = None,
    read_root: Annotated[
        list[str] | None,
        typer.Option(
            "--read-root",
            envvar="DILOCO_READ_ROOTS",
            help="read raw data only under this file, directory or prefix (repeat for more); "
            "segments the coordinator names elsewhere are refused (default: the dataset it names)",
        ),
    ] = None,
    preprocess: AllowPreprocessOpt = None,
) -> None:
    """Data worker: lease raw chunks, tokenize and pack them, write shards. Exits when done."""
    from diloco.data.worker import run_data_worker
    from diloco.plugins import allow

    setup_logging("data")
    allow(preprocess)
    sys.exit(
        run_data_worker(
            coordinator, stop_on_signals(), connect_timeout, worker_id, metrics_port, tuple(read_root or ())
        )
    )


@clear_errors
def compute(
    coordinator: CoordinatorOpt,
    device: Annotated[
        str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: the run's config)")
    ] = None,
    # The same ranges as the config keys these stand for (train.threads >= 0), checked as they are
    # parsed: before torchrun starts or anything connects.
    threads: Annotated[
        int | None, typer.Option(min=0, help="torch intra-op threads for this learner (0: torch's default)")
    ] = None,
    slow_factor: Annotated[
        float,
        typer.Option(min=1.0, help="make this learner FACTOR× slower, FACTOR >= 1 (straggler experiments)"),
    ] = 1.0,
    connect_timeout: ConnectOpt = 60.0,
    worker_id: WorkerIdOpt = None,
    state_dir: Annotated[
        str | None,
        typer.Option(help="local directory for this learner's state: with --worker-id, a restart resumes it"),
    ] = None,
    metrics_port: MetricsPortOpt = None,
    nproc: Annotated[
        int,
        typer.Option(min=1, help="ranks in this learner: starts torchrun with N ranks (DDP or FSDP inside)"),
    ] = 1,
    data_parallel: Annotated[
        DataParallelChoice,
        typer.Option(
            envvar="DILOCO_DATA_PARALLEL",
            help="inside a group of ranks: ddp (a whole "
            "replica per rank) or fsdp (each rank holds 1/N of the model: FSDP2)",
        ),
    ] = DataParallelChoice.ddp,
    model: AllowModelOpt = None,
) -> None:
    """Learner: lease shards, run inner steps, push deltas, take merged parameters."""
    from diloco.compute.group import torchrun_argv, under_torchrun
    from diloco.compute.overrides import LocalOverrides
    from diloco.compute.start import leave_rank, run_learner
    from diloco.plugins import allow

    allow(model)
    if nproc > 1 and not under_torchrun():
        args = sys.argv[sys.argv.index("compute") + 1 :]
        command = torchrun_argv(sys.executable, args, nproc)
        os.execv(command[0], command)  # the group takes this process's place (and its pid)

    setup_logging("learner")
    overrides = LocalOverrides(
        device, threads, slow_factor, connect_timeout, worker_id, state_dir, metrics_port, data_parallel.value
    )
    try:
        code = run_learner(coordinator, overrides, stop_on_signals())
    except Exception as e:
        line = error_line(e)
        if line is None or not under_torchrun():
            raise
        # A rank of a group leaves as a follower does, without the interpreter's teardown: there
        # gloo's threads aborted a rank 0 refused at join ("terminate called without an active
        # exception", twice in CI), and torchrun reported exit code 134 instead of the refusal's.
        # Its own threads were stopped before the error came up (Learner.run).
        typer.echo(line, err=True)
        leave_rank(2)
    sys.exit(code)


@clear_errors
def evaluator(
    coordinator: CoordinatorOpt,
    # The same ranges as eval.every_s (>= 0) and eval.threads (>= 1), checked before connecting.
    every: Annotated[
        float | None,
        typer.Option(min=0.0, help="seconds between evaluations (default: the run's eval.every_s)"),
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: cpu)")] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch intra-op threads (default: eval.threads)")
    ] = None,
    connect_timeout: ConnectOpt = 60.0,
    worker_id: WorkerIdOpt = None,
    model: AllowModelOpt = None,
) -> None:
    """Evaluator: the held-out loss of the published global model, now and then, for status."""
    from diloco.evaluator import run_evaluator
    from diloco.plugins import allow

    setup_logging("evaluator")
    allow(model)
    sys.exit(
        run_evaluator(
            coordinator,
            stop_on_signals(),
            connect_timeout_s=connect_timeout,
            worker_id=worker_id,
            device=device,
            threads=threads,
            every_s=every,
        )  # fmt: skip
    )


def standby(
    role: Annotated[str, typer.Option(help="the role this spare warms up for: learner | data | coordinator")],
) -> None:
    """A warm spare (started by `diloco run` under chaos): import everything, then wait on stdin for
    the command line of a process that died, and run it here."""
    from diloco.local.spare import await_assignment, run_assignment, warm_up

    warm_up(role)
    assignment = await_assignment(sys.stdin)
    if assignment is None:  # the supervisor is stopping and never needed us
        sys.exit(0)
    run_assignment(assignment)  # the whole CLI, to run the dead process's command line here
