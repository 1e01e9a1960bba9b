"""What every command shares: option types, clear one-line errors, config building, signals."""

from __future__ import annotations

import functools
import inspect
import io
import os
import signal
import threading
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer

from diloco.config import ConfigError, RunConfig, parse_assignments
from diloco.errors import DilocoError, Terminated
from diloco.store import StoreError

F = TypeVar("F", bound=Callable[..., Any])

ConfigOpt = Annotated[
    Path | None,
    # Rich reads "[model]" as markup and drops it: the brackets are escaped.
    typer.Option(
        "--config", help=r"run.toml with \[model], \[data], \[train], \[sync], \[coordinator], \[eval]"
    ),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override any config key: section.key=value (repeatable)")
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help='model factory "package.module:function" (default: the built-in GPT)'),
]


def coordinator_address(address: str) -> str:
    """--coordinator checked at parse time (HOST:PORT), before a role imports torch or waits."""
    from diloco.client import check_address

    try:
        return check_address(address)
    except DilocoError as e:
        raise typer.BadParameter(str(e).removeprefix(f"--coordinator {address!r}: ")) from None


# A worker's side of the run's code: what it lets the coordinator's config make it import.
AllowModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help='the model factory "package.module:function" this worker lets the coordinator name '
        "(diloco's own need none; DILOCO_ALLOW_CODE: more, comma-separated)",
    ),
]
AllowPreprocessOpt = Annotated[
    str | None,
    typer.Option(
        "--preprocess",
        help='the preprocess "package.module:function" this worker lets the coordinator name '
        "(DILOCO_ALLOW_CODE: more, comma-separated)",
    ),
]

CoordinatorOpt = Annotated[
    str, typer.Option("--coordinator", help="the coordinator's HOST:PORT", callback=coordinator_address)
]


def optional_coordinator_address(address: str | None) -> str | None:
    return None if address is None else coordinator_address(address)


OptionalCoordinatorOpt = Annotated[
    str | None,
    typer.Option(
        "--coordinator", help="a running coordinator's HOST:PORT", callback=optional_coordinator_address
    ),
]
WorkerIdOpt = Annotated[
    str | None, typer.Option("--worker-id", help="a stable identity for this worker (default: generated)")
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", min=0, max=65535, help="serve Prometheus /metrics here (0: any free port)"
    ),
]
ConnectOpt = Annotated[
    float, typer.Option("--connect-timeout", help="seconds to wait for the coordinator at start")
]


class DataParallelChoice(StrEnum):
    """How a learner of several ranks holds its model (diloco.compute.replicas)."""

    ddp = "ddp"
    fsdp = "fsdp"


def os_error_line(e: OSError) -> str:
    """What the operating system refused, as one line that names it: the path (both of a rename)
    and why ("runs/r1: Read-only file system"); without a path, its own words (a bind site names its
    port itself, as a DilocoError)."""
    why = e.strerror or str(e) or type(e).__name__
    paths = [
        os.fsdecode(p) if isinstance(p, bytes) else str(p) for p in (e.filename, e.filename2) if p is not None
    ]
    return f"{' -> '.join(paths)}: {why}" if paths else why


def error_line(e: BaseException) -> str | None:
    """The one line an expected failure ends in: the library's own errors, a failed coordinator
    call, and what the operating system refused (a workdir that cannot be written, a port in use).
    None for anything else (a bug: raised, with its traceback)."""
    if isinstance(e, (DilocoError, ConfigError, StoreError)):
        return f"error: {e}"
    if isinstance(e, grpc.RpcError):
        return f"error: coordinator call failed: {e.code().name}: {e.details()}"
    if isinstance(e, OSError) and not isinstance(e, io.UnsupportedOperation):  # (a stream misused: a bug)
        return f"error: {os_error_line(e)}"
    return None


def clear_errors(fn: F) -> F:
    """Expected failures (error_line) become one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (DilocoError, ConfigError, StoreError, grpc.RpcError, OSError) as e:
            line = error_line(e)
            if line is None:
                raise
            typer.echo(line, err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt as e:  # Ctrl-C: 130; SIGTERM (Terminated): 143, as a shell says
            typer.echo("terminated" if isinstance(e, Terminated) else "interrupted", err=True)
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None

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


# What --insecure does, by command: only a server has plaintext to allow. Elsewhere it is
# accepted (one set of flags may serve every role) but hidden: it would change nothing.
INSECURE_HELP = {
    "coordinator": "serve plaintext (no TLS, no token) on a --host beyond loopback, "
    "gRPC and the status page: anyone who reaches the port drives the run",
}
# Likewise --tls-crl: only a server checks the certificates it is shown.
CRL_HELP = {
    "coordinator": "certificates revoked since issued (ca.crl of `diloco certs revoke`): their calls are "
    "refused; the file is read again within a second of a change",
}


def with_security(fn: F) -> F:
    """Give a command the identity flags every role takes (--tls-cert/--tls-key/--tls-ca,
    --token-file, --insecure); given, they go into the environment, where every client and the
    coordinator of this process find them (diloco.security.transport)."""
    insecure_help, crl_help = INSECURE_HELP.get(fn.__name__), CRL_HELP.get(fn.__name__)
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        for name, annotation, default in (
            (
                "tls_cert",
                Annotated[str | None, typer.Option(help="this role's certificate (diloco certs issue)")],
                None,
            ),
            ("tls_key", Annotated[str | None, typer.Option(help="its private key")], None),
            (
                "tls_ca",
                Annotated[str | None, typer.Option(help="the run's CA certificate: mutual TLS")],
                None,
            ),
            (
                "tls_crl",
                Annotated[
                    str | None,
                    typer.Option(help=crl_help or "no effect for this command", hidden=crl_help is None),
                ],
                None,
            ),
            (
                "token_file",
                Annotated[
                    str | None,
                    typer.Option(
                        help="a shared token instead of certificates (read again when the file changes: a rotation)"
                    ),
                ],
                None,
            ),
            (
                "insecure",
                Annotated[
                    bool,
                    typer.Option(
                        help=insecure_help or "no effect for this command", hidden=insecure_help is None
                    ),
                ],
                False,
            ),
        )
    ]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from diloco.security.transport import CRL_ENV, ENV, INSECURE_ENV, TOKEN_FILE_ENV

        values = {
            k: kwargs.pop(k) for k in ("tls_cert", "tls_key", "tls_ca", "tls_crl", "token_file", "insecure")
        }
        named = (
            *((f"tls_{k}", v) for k, v in ENV.items()),
            ("tls_crl", CRL_ENV),
            ("token_file", TOKEN_FILE_ENV),
        )
        for key, variable in named:
            if values[key]:
                os.environ[variable] = str(values[key])
        if values["insecure"]:
            os.environ[INSECURE_ENV] = "1"
        return fn(*args, **kwargs)

    signature = inspect.signature(fn, eval_str=True)  # the commands use postponed annotations
    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
