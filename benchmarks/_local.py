"""A real coordinator with its shards ready (plaintext or mutual TLS), its learners joined, the rows
they leased, and a model's initial parameters: what the in-process benchmarks (ingest, wire_check,
observe, coordinator_memory) start from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import RunningCoordinator, start_coordinator
from diloco.data.worker import DataWorker
from diloco.model import build_model
from diloco.security.certs import issue
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb


def coordinator_with_shards(
    workdir: Path,
    overrides: dict[str, Any],
    security: Security | None = None,
    data: Security | None = None,
    repeats: int = 4000,
) -> RunningCoordinator:
    """A coordinator on 127.0.0.1 over a small synthetic corpus (`repeats` × 28 bytes: 4,000 make
    ~430 rows of 257 tokens), every chunk already a shard. `security`: the coordinator's (mutual
    TLS, a token; none: plaintext), `data`: its data worker's."""
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * repeats)
    cfg = RunConfig().with_overrides({"data.dataset": str(corpus), **overrides})
    running = start_coordinator(cfg, str(workdir / "coord"), security=security or Security())
    DataWorker(f"127.0.0.1:{running.port}", security=data or Security()).run()
    return running


def initial_parameters(client: CoordinatorClient) -> dict[str, torch.Tensor]:
    """The run's model, built from the config a joined client received."""
    assert client.config is not None, "join first"
    model_cfg = client.config.model
    return {n: t.detach() for n, t in build_model(model_cfg, model_cfg.vocab_size, 0).named_parameters()}


def leased_rows(clients: Sequence[CoordinatorClient]) -> dict[str, list[tuple[int, int]]]:
    """Every train shard the coordinator has, leased round-robin by the clients: each learner's
    (shard, row) pairs, one per push it may send. A delta must name rows of shards its worker
    leased, each row merged once (ledger.push_claim), as a learner's pushes do."""
    rows: dict[str, list[tuple[int, int]]] = {c.worker_id: [] for c in clients}
    open_clients = list(clients)
    while open_clients:
        for c in list(open_clients):
            lease = c.lease_shard()
            if not lease.shard_id:  # no more shards (or its cap of leases): this one is done
                open_clients.remove(c)
                continue
            rows[c.worker_id] += [(lease.shard_id, r) for r in range(lease.rows)]
    if short := [w for w, got in rows.items() if not got]:  # each pushing thread needs rows of its own
        raise SystemExit(f"no shard left for {', '.join(short)}: more data, or a smaller data.chunk_bytes")
    return rows


def corpus_repeats(rows: int) -> int:
    """Repeats of coordinator_with_shards' 28-byte text that make at least `rows` train rows of the
    default 257 tokens (a byte a token), with room for the held-out split."""
    return int(rows * 257 / 28 * 1.3) + 1


def span_of(rows: list[tuple[int, int]], worker_id: str) -> tuple[int, int]:
    """The next row a push of `worker_id` names (taken from its leased rows)."""
    if not rows:
        raise SystemExit(f"{worker_id} pushed every row it leased: give the coordinator more (--rows)")
    return rows.pop()


def with_learners(running, learners: int, security: dict[str, Security] | None = None):
    """Joined learner clients (each on its certificate, with `security`), the first having
    given the initial parameters; and those parameters."""
    address = f"127.0.0.1:{running.port}"
    names = list(security) if security else [None] * learners
    clients = [
        CoordinatorClient(address, pb.ROLE_COMPUTE, security=security[n] if n else Security()) for n in names
    ]
    for c in clients:
        c.join()
    params = initial_parameters(clients[0])
    clients[0].init_parameters(params)
    return clients, params


def mtls_coordinator(ca: Path, workdir: Path, overrides: dict[str, Any], learners: int, repeats: int = 4000):
    """A coordinator on mutual TLS (the production path) with its shards ready, `learners` learner
    clients joined on certificates of their own (signed by `ca`), its parameters, and each
    learner's (certificate, key, CA) files for the pushing process's channels."""
    files = {f"learner-{i}": issue(ca, "learner", f"learner-{i}") for i in range(learners)}
    running = coordinator_with_shards(
        workdir, overrides, Security(tls=issue(ca, "coordinator", "coordinator")),
        Security(tls=issue(ca, "data", "data-0")), repeats,
    )  # fmt: skip
    clients, params = with_learners(running, learners, {n: Security(tls=f) for n, f in files.items()})
    return running, clients, params, {n: (f.cert, f.key, f.ca) for n, f in files.items()}
