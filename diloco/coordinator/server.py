"""Start the coordinator: open (or create) the ledger, partition the dataset once, serve gRPC."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger
from diloco.coordinator.memory import keep_freed_memory
from diloco.coordinator.run_record import open_ledger, tokenizer_hash
from diloco.coordinator.service import STREAMED_REQUEST_KINDS, CoordinatorService
from diloco.coordinator.wirecount import CountRequestStreams
from diloco.coordinator.workdir import (
    lock_workdir,
    store_root,
)
from diloco.errors import DilocoError
from diloco.observe.access import access_token
from diloco.observe.events import RunEvents
from diloco.observe.http import ObserveServer
from diloco.security.guard import Guard
from diloco.security.transport import (
    Security,
    add_port,
    check_listen,
    check_serving,
    http2_frame_bytes,
)
from diloco.v1 import coordinator_pb2_grpc as pb_grpc
from diloco.wire.tensors import parse_stream_message

log = logging.getLogger("diloco.coordinator")


def grpc_options(config: RunConfig) -> list[tuple[str, int]]:
    """Message limits set on purpose: tensors stream in pieces far below them."""
    limit = config.coordinator.max_message_bytes
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC shares a port with any other gRPC server by default: a second coordinator would
        # start on a running one's port and the two would split its clients.
        ("grpc.so_reuseport", 0),
        # A fixed 4 MiB flow-control window per stream instead of one grown by BDP probing: a
        # push waiting for a slot (max_inflight_pushes) otherwise had tens of MB of its stream
        # buffered by gRPC, so memory grew with learners (benchmarks/coordinator_memory.py);
        # 4 MiB still carries ~80 MB/s per stream over a 50 ms link.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 4 << 20),
        # A pushed piece arrives as one HTTP/2 frame.
        ("grpc.http2.max_frame_size", http2_frame_bytes(config.coordinator.stream_chunk_bytes)),
    ]


def check_port_free(host: str, port: int) -> None:
    """Refuse a taken port before anything is written (ledger, partition), in one clear line.

    Binds plain sockets the way gRPC's listener will (SO_REUSEADDR, so a restart may rebind over
    TIME_WAIT connections; no SO_REUSEPORT, so a live listener conflicts) and lets them go at once.
    Like gRPC, a name with several addresses (localhost: ::1 and 127.0.0.1) needs one bindable.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise DilocoError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    errors = [_bind_error(family, address) for family, _, _, _, address in addresses]
    in_use = [e for e in errors if e is not None and e.errno == errno.EADDRINUSE]
    if in_use or all(errors):
        raise DilocoError(f"cannot listen on {host}:{port}: {(in_use or errors)[0].strerror}")


def _bind_error(family: int, address: tuple) -> OSError | None:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e
    return None


@dataclass
class RunningCoordinator:
    server: grpc.Server
    service: CoordinatorService
    ledger: Ledger
    port: int
    observers: list[ObserveServer] = field(default_factory=list)
    workdir_lock: IO[str] | None = None  # held while it runs: one coordinator per workdir

    def stop(self, grace_s: float = 2.0) -> None:
        for http in self.observers:
            http.stop()
        # The service first (its merges published), then the calls under way get grace_s. A push
        # accepted in between is recorded pending and dropped by the next life, whose learners
        # send it again. Stopping the server first left calls blocked behind the service's stop
        # past the grace: cancelled (a status watch ended on it, once in CI).
        self.service.stop()
        self.server.stop(grace_s).wait()
        self.ledger.close()
        if self.workdir_lock is not None:
            self.workdir_lock.close()


@dataclass(frozen=True)
class ObservePorts:
    """Where the coordinator is watched from: Prometheus's /metrics and the status page (None: off,
    0: any free port), on `host` (loopback unless told)."""

    metrics_port: int | None = None
    http_port: int | None = None
    host: str = "127.0.0.1"


def start_coordinator(
    config: RunConfig,
    workdir: str,
    host: str = "127.0.0.1",
    port: int = 0,
    observe: ObservePorts | None = None,
    security: Security | None = None,
) -> RunningCoordinator:
    config.validate()
    # mTLS, a token, or neither: given, else this process's (its flags put them in the environment).
    security = security if security is not None else Security.from_env()
    check_serving(security)  # a learner's certificate, say: refused here, not by every client
    if warning := check_listen(host, security):
        log.warning("%s", warning)
    serves_page = observe is not None and (observe.http_port is not None or observe.metrics_port is not None)
    # The page too, before anything is written (a refusal raises; a warning is said once).
    if serves_page and (page_warning := check_listen(observe.host, security)) and observe.host != host:
        log.warning("%s", page_warning)
    check_port_free(host, port)
    if observe is not None:  # the page's and /metrics' ports too: a first start that fails on
        for observer_port in (observe.http_port, observe.metrics_port):  # them has written the ledger
            if observer_port:
                check_port_free(observe.host, observer_port)
    keep_freed_memory()
    held = lock_workdir(workdir)
    try:
        running = _serve(config, workdir, host, port, observe, security)
    except BaseException:
        held.close()
        raise
    running.workdir_lock = held
    return running


def _serve(
    config: RunConfig, workdir: str, host: str, port: int, observe: ObservePorts | None, security: Security
) -> RunningCoordinator:
    """start_coordinator's work once it holds the workdir: the ledger, the service, the ports.
    Whatever it started is stopped again when a later step fails: a failed start that left the
    server or the merger running would hold the ledger while the workdir's lock is let go."""
    ledger, config = open_ledger(config, workdir)
    started: list[Callable[[], object]] = [ledger.close]  # undone in reverse on a failure
    try:
        return _serve_ledger(config, ledger, workdir, host, port, observe, security, started)
    except BaseException:
        for undo in reversed(started):
            with contextlib.suppress(Exception):
                undo()
        raise


def _serve_ledger(
    config: RunConfig,
    ledger: Ledger,
    workdir: str,
    host: str,
    port: int,
    observe: ObservePorts | None,
    security: Security,
    started: list[Callable[[], object]],
) -> RunningCoordinator:
    fingerprint = tokenizer_hash(config, ledger)
    root = store_root(config, workdir)
    # Workers are told the store's root with the config, so each can check the shard URIs it is
    # given against it (diloco.store.uri_under), as the coordinator checks theirs.
    config = config.with_overrides({"data.store": root})
    shard_root = store.shard_root(root)
    checkpoint_root = store.join(root, "checkpoints")
    for uri in (shard_root, checkpoint_root):
        store.makedirs(uri)
    service = CoordinatorService(
        config, ledger, checkpoint_root, shard_root, tokenizer_hash=fingerprint, events=RunEvents(workdir),
        workdir=workdir,
    )  # fmt: skip
    started.append(service.stop)  # its threads once started, its events file from now
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.coordinator.grpc_workers, thread_name_prefix="rpc"),
        options=grpc_options(config),
        maximum_concurrent_rpcs=config.coordinator.max_concurrent_rpcs or None,
        interceptors=[
            Guard(security, on_refused=service.caller_refused, on_revoked=service.caller_revoked),
            CountRequestStreams(service.wire, STREAMED_REQUEST_KINDS, parse_stream_message),
        ],
    )
    service.security_mode = security.mode + (
        " (insecure)" if security.insecure and security.mode == "none" else ""
    )
    service.revocations = security.revocations
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    try:
        bound = add_port(server, f"{host}:{port}", security)
    except RuntimeError:
        bound = 0
    if not bound:
        raise DilocoError(f"cannot listen on {host}:{port} (port in use or address unavailable)")
    server.start()
    started.append(lambda: server.stop(None).wait())
    service.start()
    observers = start_observers(service, observe or ObservePorts(), security, workdir)
    started.extend(o.stop for o in observers)
    address = f"{host}:{bound}"
    info = {"address": address, "port": bound, "pid": os.getpid(), "epoch": service.epoch}
    for o in sorted(observers, key=lambda o: not o.page):  # a /metrics of its own wins
        info["metrics_url"] = o.url + "metrics"
        info["http_port" if o.page else "metrics_port"] = o.port
        if o.page:
            info["page_url"] = o.login_url  # what a person opens: it logs the browser in
    # 0600: the page's URL carries the token that opens it.
    store.write_bytes_atomic(str(Path(workdir) / "coordinator.json"), json.dumps(info).encode(), mode=0o600)
    log.info("coordinator listening on %s epoch=%d", address, service.epoch)
    for o in observers:
        log.info("%s on %s", "status page" if o.page else "metrics", o.url)
    return RunningCoordinator(server, service, ledger, bound, observers)


def start_observers(
    service: CoordinatorService, ports: ObservePorts, security: Security, workdir: str | None = None
) -> list[ObserveServer]:
    """The HTTP servers asked for: /metrics alone on metrics_port, the page (and /metrics) on
    http_port; both behind the run's security (diloco.observe.access), with one access token."""
    wanted = [
        (port, page)
        for port, page in ((ports.metrics_port, False), (ports.http_port, True))
        if port is not None
    ]
    token = access_token(security.mode, workdir) if wanted else ""
    servers = []
    try:
        for port, page in wanted:
            servers.append(
                ObserveServer(
                    ports.host,
                    port,
                    metrics=service.metrics,
                    detail=service.status_detail,
                    events=service.events,
                    page=page,
                    security=security,
                    access_token=token,
                    on_refused=service.caller_refused,
                )  # fmt: skip
            )
    except (OSError, DilocoError) as e:
        for s in servers:
            s.stop()
        if isinstance(e, OSError):
            raise DilocoError(f"cannot serve HTTP on {ports.host}: {e.strerror or e}") from e
        raise
    return servers


def serve(
    config: RunConfig,
    workdir: str,
    host: str = "127.0.0.1",
    port: int = 0,
    observe: ObservePorts | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop accepting RPCs and close the ledger."""
    running = start_coordinator(config, workdir, host, port, observe)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("coordinator stopping")
    running.stop()
