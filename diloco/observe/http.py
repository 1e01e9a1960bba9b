"""The coordinator's read-only HTTP side: Prometheus's /metrics, and the status page.

    /              the page (page.html: self-contained, no CDN; it polls the two below)
    /api/status    the status detail, as `diloco status --json` prints it
    /api/history   the curves and the timeline, from the run's events (downsampled)
    /metrics       Prometheus text exposition

Served by the standard library's threading HTTP server on a thread of the coordinator, on
loopback unless told otherwise; it only reads. Every request passes the run's rule first
(diloco.observe.access): HTTPS and an observer certificate or the access token under mTLS, the
token in token mode, open only where the gRPC side is (plaintext on loopback, or --insecure).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import quote, urlsplit

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from diloco.errors import DilocoError
from diloco.observe.access import cookie_name, cookie_value, http_access, role_of, server_context
from diloco.observe.events import RunEvents
from diloco.observe.prometheus import CoordinatorMetrics
from diloco.security.transport import Security, check_listen

log = logging.getLogger("diloco.observe")

# Points per curve the page gets: enough to see a week's shape, few enough to load at once.
MAX_POINTS = 400
TIMELINE_KINDS = ("start", "join", "leave", "chunk_failed")
MAX_TIMELINE = 300
# A client gets this long to finish its TLS handshake and send its request (its own thread waits).
REQUEST_TIMEOUT_S = 30.0

Route = Callable[[], tuple[str, bytes]]
TEXT = "text/plain; charset=utf-8"


def downsample(points: list[list[float]], max_points: int = MAX_POINTS) -> list[list[float]]:
    """At most `max_points`, evenly spread, the first and last kept."""
    if len(points) <= max_points:
        return points
    step = (len(points) - 1) / (max_points - 1)
    return [points[round(i * step)] for i in range(max_points)]


def history(events: list[dict[str, Any]], max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The page's curves (time in seconds since the epoch, value) and its timeline."""
    learner_loss: dict[str, list[list[float]]] = {}
    eval_loss, merged_rate, wire_per_token, round_loss = [], [], [], []
    timeline = []
    for e in events:
        kind, at = e["kind"], e["at"]
        if kind == "learner" and e.get("loss"):
            learner_loss.setdefault(e["worker_id"], []).append([at, e["loss"]])
        elif kind == "eval":
            eval_loss.append([at, e["loss"]])
        elif kind == "merge" and e.get("mean_loss") is not None:
            round_loss.append([at, e["mean_loss"]])
        elif kind == "progress":
            merged_rate.append([at, e["merged_tokens_per_s"]])
            if e.get("wire_bytes_per_token") is not None:
                wire_per_token.append([at, e["wire_bytes_per_token"]])
        if kind in TIMELINE_KINDS and (kind != "chunk_failed" or e.get("quarantined")):
            timeline.append(
                {
                    k: v
                    for k, v in e.items()
                    if k in ("kind", "at", "worker_id", "role", "reason", "epoch", "chunk", "error")
                }
            )
    return {
        "learner_loss": {w: downsample(p, max_points) for w, p in sorted(learner_loss.items())},
        "eval_loss": downsample(eval_loss, max_points),
        "round_loss": downsample(round_loss, max_points),
        "merged_tokens_per_s": downsample(merged_rate, max_points),
        "wire_bytes_per_token": downsample(wire_per_token, max_points),
        "timeline": timeline[-MAX_TIMELINE:],
    }


def page_html() -> bytes:
    return (resources.files("diloco.observe") / "page.html").read_bytes()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake (a plaintext client, an unknown CA) is the client's problem, not ours.
        log.debug("HTTP connection from %s failed", client_address, exc_info=True)


def bind(host: str, port: int, handler: type[BaseHTTPRequestHandler], what: str) -> _Server:
    """The listening server, or one line that names the endpoint and its port: a port in use is
    an operator's to fix (another process, an earlier run still up), not a traceback."""
    try:
        return _Server((host, port), handler)
    except OSError as e:
        raise DilocoError(f"cannot serve {what} on {host}:{port}: {e.strerror or e}") from None


class GuardedServer:
    """Routes served on a thread of their own, each request checked by `http_access` first:
    HTTPS when `security` has TLS, and a refusal (401) counted through `on_refused`."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Route],
        *,
        security: Security,
        access_token: str,
        on_refused: Callable[[str, str, str], None] | None = None,
        name: str = "observe-http",
        bearer_also: Callable[[], Sequence[str]] | None = None,
        what: str = "HTTP",
    ):
        """`what`: the endpoint, as a refused bind names it ("the status page", "the learner's
        /metrics (--metrics-port)")."""
        if warning := check_listen(host, security):  # the gRPC side's rule, and its --insecure
            log.warning("%s", warning)
        context = server_context(security.tls) if security.tls else None
        mode, refused = security.mode, on_refused or (lambda method, why, peer: None)
        revocations = security.revocations

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def setup(self) -> None:
                super().setup()
                if context is not None:  # here, on the request's thread: a slow client stalls no other
                    self.request.do_handshake()

            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                path = urlsplit(self.path).path
                route = routes.get(path)
                if route is None:
                    self.send_error(404, "not found")
                    return
                verdict = http_access(
                    mode,
                    self.path,
                    authorization=self.headers.get("Authorization", ""),
                    cookie=self.headers.get("Cookie", ""),
                    cert_role=role_of(self.request.getpeercert(), revocations) if context is not None else "",
                    token=access_token,
                    cookie_key=server.cookie,
                    bearer_also=bearer_also() if bearer_also is not None else (),
                )
                if not verdict.allowed:
                    refused(
                        f"http {path}", verdict.reason, f"{self.client_address[0]}:{self.client_address[1]}"
                    )
                    challenge = {"WWW-Authenticate": 'Bearer realm="diloco"'}
                    self._reply(401, TEXT, f"{verdict.reason}\n".encode(), challenge)
                    return
                if verdict.login:  # the cookie carries the login; the token leaves the address bar
                    cookie = (
                        f"{server.cookie}={cookie_value(access_token)}; Path=/; HttpOnly; SameSite=Strict"
                    )
                    secure = "; Secure" if context is not None else ""
                    self._reply(303, TEXT, b"logged in\n", {"Location": "/", "Set-Cookie": cookie + secure})
                    return
                try:
                    kind, body = route()
                except Exception as e:  # a failed read answers 500, never stops the server
                    log.warning("%s failed: %s", path, e)
                    self.send_error(500, str(e))
                    return
                self._reply(200, kind, body)

            def _reply(
                self, code: int, kind: str, body: bytes, headers: dict[str, str] | None = None
            ) -> None:
                self.send_response(code)
                headers = {"Content-Type": kind, "Cache-Control": "no-store", **(headers or {})}
                headers["Content-Length"] = str(len(body))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # a page polling every 2 s would flood the coordinator's log

        server = self
        self.httpd = bind(host, port, Handler, what)
        if context is not None:
            # Handshakes happen in Handler.setup, not in the accepting thread.
            self.httpd.socket = context.wrap_socket(
                self.httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self.tls, self.access_token = context is not None, access_token
        self.host, self.port = host, self.httpd.server_address[1]
        self.cookie = cookie_name(self.port)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}/"

    @property
    def login_url(self) -> str:
        """The URL a person opens: the page, with the token that logs the browser in (if any)."""
        return f"{self.url}?token={quote(self.access_token, safe='')}" if self.access_token else self.url

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


class ObserveServer(GuardedServer):
    """The coordinator's HTTP side. `page` False: only /metrics (the --metrics-port one)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: CoordinatorMetrics,
        detail: Callable[[], dict[str, Any]],
        events: RunEvents,
        page: bool,
        security: Security,
        access_token: str,
        on_refused: Callable[[str, str, str], None] | None = None,
    ):
        routes: dict[str, Route] = {
            "/metrics": lambda: (CONTENT_TYPE_LATEST, generate_latest(metrics.registry)),
        }
        if page:
            routes.update(
                {
                    "/": lambda: ("text/html; charset=utf-8", page_html()),
                    "/api/status": lambda: ("application/json", json.dumps(detail()).encode()),
                    "/api/history": lambda: (
                        "application/json",
                        json.dumps(history(events.recent())).encode(),
                    ),
                }
            )
        self.page = page
        super().__init__(
            host, port, routes, security=security, access_token=access_token, on_refused=on_refused,
            # The run's token as a bearer: the token file's latest (a rotation), in token mode.
            bearer_also=(lambda: security.tokens.accepted(time.monotonic())) if security.mode == "token" else None,
            what="the status page (--http-port)" if page else "the coordinator's /metrics (--metrics-port)",
        )  # fmt: skip
