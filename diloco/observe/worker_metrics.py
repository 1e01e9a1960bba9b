"""A worker's own Prometheus metrics (`diloco compute --metrics-port`, `diloco data --metrics-port`):
what it has done in this life, read from its counters when scraped. The coordinator's /metrics
has the whole run; these are for a machine's own dashboards and alerts.

Plain HTTP (a worker's certificate is a client's, not a server's): with the run's token, a scrape
carries it (`Authorization: Bearer`); beyond loopback it needs the token or --insecure."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from diloco.observe.http import GuardedServer
from diloco.security.transport import Security

# name -> (kind, help); a snapshot's key is the name without the role's prefix.
LEARNER = {
    "inner_steps": ("counter", "Inner steps taken"),
    "tokens_trained": ("counter", "Tokens (or samples) trained"),
    "busy_seconds": ("counter", "Time in inner steps"),
    "data_stall_seconds": ("counter", "Time waiting for data"),
    "sync_wait_seconds": ("counter", "Time waiting for the syncer"),
    "budget_wait_seconds": ("counter", "Time waiting for an allowance of the token budget, then training on"),
    "inner_loss": ("gauge", "The last inner step's loss"),
    "tokens_per_second": ("gauge", "Tokens per second of inner-step time"),
}
DATA_WORKER = {
    "chunks_done": ("counter", "Chunks made into shards"),
    "tokens_prepared": ("counter", "Tokens (or samples) written to shards"),
    "busy_seconds": ("counter", "Time making shards"),
}


class SnapshotCollector(Collector):
    def __init__(
        self,
        prefix: str,
        spec: dict[str, tuple[str, str]],
        snapshot: Callable[[], dict[str, float]],
        worker_id: Callable[[], str],
    ):
        self.prefix, self.spec, self.snapshot, self.worker_id = prefix, spec, snapshot, worker_id

    def collect(self) -> Iterator[Metric]:
        values = self.snapshot()
        for key, (kind, what) in self.spec.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(f"{self.prefix}_{key}", what, labels=["worker"])
            metric.add_metric([self.worker_id()], float(values.get(key, 0.0)))
            yield metric


def serve_worker_metrics(
    role: str,
    port: int,
    host: str,
    snapshot: Callable[[], dict[str, float]],
    worker_id: Callable[[], str],
    security: Security | None = None,
) -> Any:
    """Start serving on a daemon thread; returns the server (its .server_port, .shutdown()).
    `security`: the worker's own (else this process's, from its flags' environment). A port that
    cannot be bound (in use) is a DilocoError naming it: one line from the CLI."""
    prefix, spec = ("diloco_learner", LEARNER) if role == "learner" else ("diloco_data_worker", DATA_WORKER)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(prefix, spec, snapshot, worker_id))
    security = security if security is not None else Security.from_env()
    # The certificate does not protect a plaintext port: only the token (or --insecure) counts.
    plain = Security(token=security.token, insecure=security.insecure)
    routes = {"/metrics": lambda: (CONTENT_TYPE_LATEST, generate_latest(registry))}
    # The run's token as a bearer only (what Prometheus sends; no login link, no cookie), the token
    # file's latest: a rotation reaches this port too.
    server = GuardedServer(
        host, port, routes, security=plain, access_token="", name=f"{role}-metrics",
        bearer_also=lambda: security.tokens.accepted(time.monotonic()),
        what=f"the {'learner' if role == 'learner' else 'data worker'}'s /metrics (--metrics-port)",
    )  # fmt: skip
    return server.httpd
