"""Settings that belong to the learner's machine, not to the run (the CLI's `diloco compute` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LocalOverrides:
    """Settings that belong to this machine, not to the run."""

    device: str | None = None
    threads: int | None = None
    # Make this learner FACTOR× slower: after each step, sleep (FACTOR − 1)× its compute time.
    slow_factor: float = 1.0
    connect_timeout_s: float = 60.0
    # A stable identity (e.g. the host's name) instead of a generated one.
    worker_id: str | None = None
    # Where this learner keeps its state on local disk (with a stable worker_id only; None: off).
    state_dir: str | None = None
    # Serve this learner's own Prometheus metrics on this loopback port (0: any free one; None: off).
    metrics_port: int | None = None
    # Inside a torchrun group: "ddp" (a whole replica per rank) or "fsdp" (sharded, FSDP2).
    data_parallel: str = "ddp"
