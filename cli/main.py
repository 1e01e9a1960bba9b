"""The `diloco` command line. It parses options and calls the library; nothing else lives here."""

from __future__ import annotations

import functools
import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer

from diloco.config import ConfigError, RunConfig, parse_assignments
from diloco.errors import DilocoError
from diloco.logs import setup_logging
from diloco.store import StoreError

app = typer.Typer(
    help="Resilient, low-communication distributed training (Decoupled DiLoCo).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

F = TypeVar("F", bound=Callable[..., Any])

ConfigOpt = Annotated[
    Path | None,
    # Rich reads "[model]" as markup and drops it: the brackets are escaped.
    typer.Option("--config", help=r"run.toml with \[model], \[data], \[train], \[sync], \[coordinator]"),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override any config key: section.key=value (repeatable)")
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help='model factory "package.module:function" (default: the built-in GPT)'),
]
CoordinatorOpt = Annotated[str, typer.Option("--coordinator", help="the coordinator's HOST:PORT")]
WorkerIdOpt = Annotated[
    str | None, typer.Option("--worker-id", help="a stable identity for this worker (default: generated)")
]
ConnectOpt = Annotated[
    float, typer.Option("--connect-timeout", help="seconds to wait for the coordinator at start")
]


def clear_errors(fn: F) -> F:
    """Expected failures become one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (DilocoError, ConfigError, StoreError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except grpc.RpcError as e:
            typer.echo(f"error: coordinator call failed: {e.code().name}: {e.details()}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def build_config(
    base: RunConfig, config: Path | None, sets: list[str] | None, flags: dict[str, Any]
) -> RunConfig:
    """base <- TOML file <- --set assignments <- dedicated flags; then validated."""
    cfg = base.merged_with_toml(config) if config else base
    cfg = cfg.with_overrides(parse_assignments(sets or []))
    return cfg.with_overrides(flags).validate()


def stop_on_signals() -> threading.Event:
    """SIGTERM / SIGINT set an event the worker loops watch: leases are returned, exit is 0."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@app.command()
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
) -> None:
    """Serve membership, leases, the syncer and status over gRPC."""
    from diloco.coordinator.server import serve

    setup_logging("coordinator")
    cfg = build_config(
        RunConfig(), config, set_, {"data.dataset": dataset, "data.store": store, "model.factory": model}
    )
    serve(cfg, str(workdir), host, port)


@app.command()
@clear_errors
def data(
    coordinator: CoordinatorOpt, connect_timeout: ConnectOpt = 60.0, worker_id: WorkerIdOpt = None
) -> None:
    """Data worker: lease raw chunks, tokenize and pack them, write shards. Exits when done."""
    from diloco.data.worker import run_data_worker

    setup_logging("data")
    sys.exit(run_data_worker(coordinator, stop_on_signals(), connect_timeout, worker_id))


@app.command()
@clear_errors
def compute(
    coordinator: CoordinatorOpt,
    device: Annotated[
        str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: the run's config)")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads for this learner")] = None,
    slow_factor: Annotated[
        float, typer.Option(help="make this learner FACTOR× slower (straggler experiments)")
    ] = 1.0,
    connect_timeout: ConnectOpt = 60.0,
    worker_id: WorkerIdOpt = None,
    state_dir: Annotated[
        str | None,
        typer.Option(help="local directory for this learner's state: with --worker-id, a restart resumes it"),
    ] = None,
) -> None:
    """Learner: lease shards, run inner steps, push deltas, take merged parameters."""
    from diloco.compute.learner import run_learner
    from diloco.compute.overrides import LocalOverrides

    setup_logging("learner")
    overrides = LocalOverrides(device, threads, slow_factor, connect_timeout, worker_id, state_dir)
    sys.exit(run_learner(coordinator, overrides, stop_on_signals()))


@app.command()
@clear_errors
def evaluator(
    coordinator: CoordinatorOpt,
    every: Annotated[
        float | None, typer.Option(help="seconds between evaluations (default: the run's eval.every_s)")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: cpu)")] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch intra-op threads (default: eval.threads)")
    ] = None,
    connect_timeout: ConnectOpt = 60.0,
    worker_id: WorkerIdOpt = None,
) -> None:
    """Evaluator: the held-out loss of the published global model, now and then, for status."""
    from diloco.evaluator import run_evaluator

    setup_logging("evaluator")
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


@app.command()
@clear_errors
def run(
    minutes: Annotated[
        float, typer.Option(help="wall-clock budget (0: until the data or token budget ends)")
    ] = 5.0,
    tokens: Annotated[int, typer.Option(help="token budget over all learners (0: none)")] = 0,
    learners: Annotated[int, typer.Option(help="learner processes (M)")] = 2,
    data_workers: Annotated[int, typer.Option(help="data worker processes")] = 2,
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
    slow_learner: Annotated[float, typer.Option(help="make one learner FACTOR× slower (experiments)")] = 1.0,
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
) -> None:
    """Run a whole job on this machine: coordinator, data workers and learners as processes."""
    from diloco.local.launch import LocalRunOptions, default_run_config, run_local

    if learners < 1 or data_workers < 1:
        raise DilocoError("--learners and --data-workers must be at least 1")
    roles = tuple(r.strip() for r in chaos_roles.split(",") if r.strip())
    if unknown := set(roles) - {"coordinator", "data", "learner", "evaluator"}:
        raise DilocoError(f"--chaos-roles: unknown role(s) {', '.join(sorted(unknown))}")
    cfg = build_config(
        default_run_config(),
        config,
        set_,
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
            data_workers=data_workers,
            workdir=str(workdir) if workdir else None,
            name=name,
            slow_learner=slow_learner,
            chaos_interval=chaos_interval,
            chaos_roles=roles,
            show_progress=not no_progress,
        )
    )


@app.command()
@clear_errors
def status(
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="a running coordinator's HOST:PORT")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the full status as JSON")] = False,
    audit: Annotated[
        bool, typer.Option("--audit", help="check the ledger's invariants; exit 1 on a violation")
    ] = False,
    workdir: Annotated[Path | None, typer.Option(help="a coordinator's state dir (for --audit)")] = None,
) -> None:
    """Show a running coordinator's state, or (--audit --workdir DIR) prove its ledger's promises."""
    from diloco.client import CoordinatorClient
    from diloco.v1 import coordinator_pb2 as pb
    from diloco.views import status_lines

    if audit:
        from diloco.coordinator.audit import audit as audit_ledger

        if workdir is None:
            raise DilocoError("--audit needs --workdir (the coordinator's state dir)")
        report = audit_ledger(workdir)
        typer.echo(
            json.dumps(report.to_dict(), indent=2)
            if as_json
            else ("audit ok" if report.ok else "audit FAILED:\n  " + "\n  ".join(report.violations))
        )
        raise typer.Exit(0 if report.ok else 1)
    if coordinator is None:
        raise DilocoError("give --coordinator HOST:PORT (or --audit --workdir DIR)")
    client = CoordinatorClient(coordinator, pb.ROLE_OBSERVER, retry_deadline_s=5)
    client.wait_ready(5)
    detail = client.status()
    client.close()
    if as_json:
        typer.echo(json.dumps(detail, indent=2))
        return
    for line in status_lines(detail):
        typer.echo(line)


@app.command()
@clear_errors
def export(
    run: Annotated[Path, typer.Argument(help="the run's directory (the coordinator's workdir)")],
    out: Annotated[Path, typer.Option(help="directory to write the model to")],
    format_: Annotated[
        str, typer.Option("--format", help="hf (from_pretrained loads it) | safetensors (any model)")
    ] = "safetensors",
) -> None:
    """Write the run's global model: a Hugging Face directory, or safetensors with its config."""
    from diloco.export import export_run

    for path in export_run(run, out, format_):
        typer.echo(str(path))


tokenizer_app = typer.Typer(help="Tokenizers for `data.tokenizer`.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("train")
@clear_errors
def tokenizer_train(
    dataset: Annotated[str, typer.Option(help='"stdlib", a directory, glob or file (local or s3://)')],
    vocab: Annotated[int, typer.Option(help="vocabulary size, end-of-text included (>= 257)")],
    store: Annotated[
        str | None, typer.Option(help="URI of the run's store: writes <store>/tokenizer/tokenizer.json")
    ] = None,
    out: Annotated[
        str | None, typer.Option(help="URI of the tokenizer.json to write (overrides --store)")
    ] = None,
    max_bytes: Annotated[
        int, typer.Option(help="text sampled for training, spread over the files by size")
    ] = 200_000_000,
    text_field: Annotated[
        str, typer.Option(help="the text field of .jsonl records and .parquet files")
    ] = "text",
) -> None:
    """Train a byte-level BPE over a dataset's texts; print the tokenizer.json URI and its sha256."""
    from diloco.tokenizer_train import default_output, train_tokenizer

    setup_logging("tokenizer")
    result = train_tokenizer(
        dataset, vocab, out or default_output(store or "."), max_bytes=max_bytes, text_field=text_field
    )
    typer.echo(f"tokenizer {result.uri}")
    typer.echo(f"sha256 {result.sha256}")
    typer.echo(
        f"vocab {result.vocab_size} (end-of-text id {result.eot_id}), trained on {result.sample_bytes:,} "
        f"characters of {result.files} files"
    )
    typer.echo(f"use it with: --set data.tokenizer={result.uri}")


@app.command(hidden=True)
def standby(
    role: Annotated[str, typer.Option(help="the role this spare warms up for: learner | data | coordinator")],
) -> None:
    """A warm spare (started by `diloco run` under chaos): import everything, then wait on stdin for
    the command line of a process that died, and run it here."""
    from diloco.local.spare import await_assignment, take_over, warm_up

    warm_up(role)
    assignment = await_assignment(sys.stdin)
    if assignment is None:  # the supervisor is stopping and never needed us
        sys.exit(0)
    take_over(assignment)
    app(args=assignment.args, prog_name="diloco")
