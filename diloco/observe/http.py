"""The coordinator's read-only HTTP side: Prometheus's /metrics, and the status page.

    /              the page (page.html: self-contained, no CDN; it polls the two below)
    /api/status    the status detail, as `diloco status --json` prints it
    /api/history   the curves and the timeline, from the run's events (downsampled)
    /metrics       Prometheus text exposition

Served by the standard library's threading HTTP server on a thread of the coordinator, on
loopback unless told otherwise; it only reads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from diloco.observe.events import RunEvents
from diloco.observe.prometheus import CoordinatorMetrics

log = logging.getLogger("diloco.observe")

# Points per curve the page gets: enough to see a week's shape, few enough to load at once.
MAX_POINTS = 400
TIMELINE_KINDS = ("start", "join", "leave", "chunk_failed")
MAX_TIMELINE = 300


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


class ObserveServer:
    """An HTTP server on its own thread. `page` False: only /metrics (the --metrics-port one)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: CoordinatorMetrics,
        detail: Callable[[], dict[str, Any]],
        events: RunEvents,
        page: bool,
    ):
        routes: dict[str, Callable[[], tuple[str, bytes]]] = {
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

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    self.send_error(404, "not found")
                    return
                try:
                    kind, body = route()
                except Exception as e:  # a failed read answers 500, never stops the server
                    log.warning("%s failed: %s", self.path, e)
                    self.send_error(500, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # a page polling every 2 s would flood the coordinator's log

        self.page = page
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="observe-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
