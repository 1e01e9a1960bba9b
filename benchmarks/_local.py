"""A real coordinator with its shards ready, and a model's initial parameters: what the in-process
benchmarks (ingest, wire_check) start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import RunningCoordinator, start_coordinator
from diloco.data.worker import DataWorker
from diloco.model import build_model
from diloco.security.transport import Security


def coordinator_with_shards(
    workdir: Path, overrides: dict[str, Any], security: Security | None = None, data: Security | None = None
) -> RunningCoordinator:
    """A coordinator on 127.0.0.1 over a small synthetic corpus, every chunk already a shard.
    `security`: the coordinator's (mutual TLS, a token; none: plaintext), `data`: its data worker's."""
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 4000)
    cfg = RunConfig().with_overrides({"data.dataset": str(corpus), **overrides})
    running = start_coordinator(cfg, str(workdir / "coord"), security=security or Security())
    DataWorker(f"127.0.0.1:{running.port}", security=data or Security()).run()
    return running


def initial_parameters(client: CoordinatorClient) -> dict[str, torch.Tensor]:
    """The run's model, built from the config a joined client received."""
    assert client.config is not None, "join first"
    model_cfg = client.config.model
    return {n: t.detach() for n, t in build_model(model_cfg, model_cfg.vocab_size, 0).named_parameters()}
