"""Tools around a run: its status, finishing it, its model exported, tokenizers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer

from cli.common import OptionalCoordinatorOpt, clear_errors
from diloco.errors import DilocoError
from diloco.logs import setup_logging

# A refresh the coordinator does not answer in this long is shown as an outage (and tried again).
STATUS_TIMEOUT_S = 10.0
# A JSON reply's run state, as a person reads it.
RUN_STATE_NAMES = {1: "running", 2: "finishing", 3: "finished"}


@clear_errors
def status(
    coordinator: OptionalCoordinatorOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the full status as JSON")] = False,
    audit: Annotated[
        bool, typer.Option("--audit", help="check the ledger's invariants; exit 1 on a violation")
    ] = False,
    workdir: Annotated[
        Path | None,
        typer.Option(help="a coordinator's state dir (for --audit), or a live `diloco run` job's workdir"),
    ] = None,
    watch: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="refresh every SECONDS until Ctrl-C (0: once); a coordinator that does not answer "
            "(restarting) is waited for",
        ),
    ] = 0.0,
    refreshes: Annotated[int, typer.Option(hidden=True, help="with --watch: stop after N (tests)")] = 0,
) -> None:
    """Show a running coordinator's state (--coordinator, or a live `diloco run` job's --workdir), or
    (--audit --workdir DIR) prove its ledger's promises."""
    from diloco.client import CoordinatorClient
    from diloco.v1 import coordinator_pb2 as pb
    from diloco.views import status_tables

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
    if coordinator is None and workdir is None:
        raise DilocoError(
            "give --coordinator HOST:PORT, or --workdir of a live `diloco run` (or --audit --workdir DIR)"
        )
    from diloco.local.tls import coordinator_target

    address, security = coordinator_target(coordinator, workdir)
    client = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=5, security=security)
    try:
        from rich.console import Console, Group
        from rich.text import Text

        console = Console(width=160)
        if watch > 0 and not as_json:  # no wait_ready: a coordinator not answering yet is waited for
            from rich.live import Live

            live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
            last: list[Any] = []  # the latest picture: kept on screen, under an outage's line

            def show(detail: dict[str, Any] | None, down: str | None) -> None:
                if detail is not None:
                    last[:] = [status_tables(detail)]
                shown = status_tables(detail) if detail is not None else Text(down or "", style="bold red")
                if live is None:  # not a terminal (a log, a pipe): each refresh in turn
                    console.print(shown)
                else:
                    live.update(shown if detail is not None else Group(shown, *last))

            def fetch() -> dict[str, Any]:
                return client.status(STATUS_TIMEOUT_S, once=True)

            from diloco.observe.watch import job_ended, watch_status
            from diloco.security.transport import handshake_problem

            with live or contextlib.nullcontext():
                watch_status(  # until Ctrl-C (exit 130), or the finished run's coordinator is gone
                    fetch,
                    show,
                    watch,
                    refreshes=refreshes or None,
                    ended=(lambda: job_ended(workdir))
                    if workdir is not None and coordinator is None
                    else (lambda: None),
                    handshake=lambda details: handshake_problem(details, client.security, address),
                )
            return
        client.wait_ready(5)
        detail = client.status()
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(detail, indent=2))
        return
    console.print(status_tables(detail))


@clear_errors
def finish(
    coordinator: OptionalCoordinatorOpt = None,
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="a live `diloco run` job's workdir: its address, and its supervisor's (operator) certificate"
        ),
    ] = None,
    reason: Annotated[str, typer.Option(help="why, for the coordinator's log")] = "asked by an operator",
) -> None:
    """Finish a run: the coordinator stops handing out work, its learners push what they hold and
    leave, and it is finished once their work is merged. Takes the operator's identity (an
    `operator` certificate under mutual TLS, or the run's token). Prints the run's state."""
    from diloco.client import CoordinatorClient
    from diloco.local.tls import coordinator_target
    from diloco.v1 import coordinator_pb2 as pb

    address, security = coordinator_target(coordinator, workdir, operator=True)
    client = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=5, security=security)
    try:
        client.wait_ready(5)
        try:
            reply = client.finish(reason, timeout_s=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            raise DilocoError(
                f"the coordinator at {address} refused to finish the run: {e.details()} (finishing takes "
                "an operator's certificate: diloco certs issue --role operator)"
            ) from None
    finally:
        client.close()
    typer.echo(f"run {RUN_STATE_NAMES.get(reply.run_state, 'state unknown')}")


# The run's weights may be another model's than its config names (a user's own training loop on a
# coordinator started without --model): this names the factory that fits them.
RunModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help='the factory of the model the weights are, "package.module:function" (default: the run\'s)',
    ),
]


@clear_errors
def export(
    out: Annotated[Path, typer.Option(help="directory to write the model to")],
    run: Annotated[
        Path | None, typer.Argument(help="the run's directory (the coordinator's workdir)")
    ] = None,
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="a live run's HOST:PORT: its latest published model")
    ] = None,
    format_: Annotated[
        str, typer.Option("--format", help="hf (from_pretrained loads it) | safetensors (any model)")
    ] = "safetensors",
    model: RunModelOpt = None,
) -> None:
    """Write the run's global model: a Hugging Face directory, or safetensors with its config."""
    from diloco.export import export_run, write_model

    if coordinator is not None and run is None:
        from diloco.results import load_model

        loaded = load_model(None, coordinator, model)
        written = write_model(loaded.cfg, loaded.model, loaded.versions, out, format_)
    elif run is not None and coordinator is None:
        written = export_run(run, out, format_, model)
    else:
        raise DilocoError("give a run directory or --coordinator HOST:PORT")
    for path in written:
        typer.echo(str(path))


RunArg = Annotated[
    Path | None, typer.Argument(help="a run's directory, or a weights file in one (its model.safetensors)")
]
LiveOpt = Annotated[
    str | None, typer.Option("--coordinator", help="a live run's HOST:PORT: its latest published model")
]
DeviceOpt = Annotated[
    str, typer.Option(help="where the model runs: auto (cuda when present), cpu, cuda, cuda:N")
]


@clear_errors
def eval_(
    run: RunArg = None,
    coordinator: LiveOpt = None,
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="a live `diloco run` job's workdir: its latest published model, pulled from its "
            "coordinator with an evaluator's certificate from the job's CA (RUN instead reads the "
            "ledger's, no coordinator needed)"
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="evaluate on this data (made like the run's) instead of the held-out split"),
    ] = None,
    max_batches: Annotated[
        int, typer.Option(min=0, help="batches of train.batch_size rows at most (0: all)")
    ] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    device: DeviceOpt = "auto",
    model: RunModelOpt = None,
) -> None:
    """The model's loss (and metrics) on the run's held-out split or on your data: of a run's
    directory (RUN, read offline), or a live run's latest model (--coordinator, or --workdir of a
    `diloco run` job)."""
    from diloco.results import evaluate_loaded, load_model

    loaded = load_model(run, coordinator, model, workdir)
    result = evaluate_loaded(loaded, dataset, max_batches or None, device)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    unit = f" {result['loss_unit']}" if result.get("loss_unit") else ""
    typer.echo(f"model {result['model']}")
    typer.echo(f"data {result['data']}: {result['rows']:,} rows")
    typer.echo(f"loss {result['loss']:.4f}{unit}")
    for name, value in sorted(result["metrics"].items()):
        typer.echo(f"{name} {value:.4f}")
    if result.get("baseline_loss") is not None:
        typer.echo(f"unigram baseline {result['baseline_loss']:.4f}{unit}")


@clear_errors
def generate(
    run: RunArg = None,
    coordinator: LiveOpt = None,
    prompt: Annotated[str, typer.Option(help="the text to continue")] = "def ",
    tokens: Annotated[int, typer.Option(min=1, help="tokens to sample")] = 200,
    temperature: Annotated[float, typer.Option(help="sampling temperature, >= 0 (0: greedy)")] = 0.8,
    seed: Annotated[
        int, typer.Option(help="sampling seed: the same seed gives the same text on one device")
    ] = 0,
    device: DeviceOpt = "auto",
    model: RunModelOpt = None,
) -> None:
    """A token model continues the prompt."""
    from diloco.evaluate import check_sampling
    from diloco.results import generate_text, load_model

    check_sampling(tokens, temperature)  # before a model is loaded (or a coordinator called)
    loaded = load_model(run, coordinator, model)
    typer.echo(generate_text(loaded, prompt, tokens, temperature, seed, device))


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


@clear_errors
def certs_init(out: Annotated[Path, typer.Option(help="directory for the CA (ca.crt, ca.key)")]) -> None:
    """Make the run's certificate authority."""
    from diloco.security.certs import init_ca

    typer.echo(str(init_ca(out)))


@clear_errors
def certs_issue(
    out: Annotated[Path, typer.Option(help="the CA's directory; the certificate is written there too")],
    role: Annotated[str, typer.Option(help="coordinator | learner | data | evaluator | observer | operator")],
    name: Annotated[str, typer.Option(help="the worker's name: its worker id (--worker-id)")],
    host: Annotated[
        list[str] | None, typer.Option(help="a coordinator's address other than 127.0.0.1 (repeatable)")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            help="replace another role's or name's <name>.crt/.key; the same role and name is replaced "
            "anyway (rotation)"
        ),
    ] = False,
) -> None:
    """Issue a certificate for one worker (or the coordinator), signed by the run's CA."""
    from diloco.security.certs import issue

    files = issue(out, role, name, out, tuple(host or ()), force=force)
    typer.echo(f"--tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")


@clear_errors
def certs_revoke(
    out: Annotated[Path, typer.Option(help="the CA's directory; the list is written there (ca.crl)")],
    name: Annotated[
        str | None, typer.Option(help="revoke <out>/<name>.crt, as `certs issue` wrote it")
    ] = None,
    cert: Annotated[Path | None, typer.Option(help="revoke this certificate file instead")] = None,
) -> None:
    """Revoke a certificate the run's CA issued: a coordinator started with --tls-crl <out>/ca.crl
    refuses its calls from its next one (the file is read again when it changes)."""
    from diloco.errors import DilocoError
    from diloco.security.revocation import revoke

    if (name is None) == (cert is None):
        raise DilocoError("give one of --name (a certificate in --out) or --cert (a certificate file)")
    crl, serial, role, who = revoke(out, cert if cert is not None else out / f"{name}.crt")
    typer.echo(f"revoked {role or 'no role'} {who} (serial {serial:x}) in {crl}")
    typer.echo(f"a coordinator checks it with: --tls-crl {crl}")
