"""What a local job is asked to do (`diloco run`'s flags), and the configuration it runs by default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.local.chaos import KILLABLE_ROLES


def default_run_config() -> RunConfig:
    """The embedded default: the stdlib corpus, a small GPT, Decoupled DiLoCo (K = 1, P = 2, H = 50).

    Chunks are small (256 KiB) so that ~45 chunks spread over the data workers and a few are held
    out for evaluation.
    """
    cfg = RunConfig()
    cfg.data.chunk_bytes = 256 * 1024
    cfg.coordinator.lease_ttl_s = 15.0
    return cfg


def learner_id(i: int) -> str:
    """The worker id of a local job's i-th learner (the same in every job on a workdir: a resumed
    learner finds its local state by it)."""
    return f"learner-{i}"


@dataclass
class LocalRunOptions:
    config: RunConfig = field(default_factory=default_run_config)
    minutes: float = 5.0
    tokens: int = 0
    learners: int = 2
    # Ranks per learner: each learner a torchrun group of this many processes (DDP or FSDP inside); one
    # figure per learner (the last repeats: (1,) is every learner one process, (2, 1) a 2-rank
    # learner beside 1-rank ones).
    learner_ranks: tuple[int, ...] = (1,)
    # How a learner of several ranks holds its model: "ddp" or "fsdp" (diloco.compute.replicas).
    data_parallel: str = "ddp"
    data_workers: int = 2
    workdir: str | None = None
    name: str | None = None
    # One learner made FACTOR× slower by an injected delay per inner step (1.0: none).
    slow_learner: float = 1.0
    show_progress: bool = True
    # Mean seconds between SIGKILLs of random processes, coordinator included (0: no chaos).
    chaos_interval: float = 0.0
    # The roles chaos may kill (empty: coordinator, data and learner alike).
    chaos_roles: tuple[str, ...] = ()
    # The coordinator's status page and Prometheus /metrics, on loopback (0: a free port; None: off).
    http_port: int | None = 0
    metrics_port: int | None = None
    # Mutual TLS between every process (certificates made in <workdir>/tls); False: plaintext.
    tls: bool = True
    # The address the coordinator listens on and every process dials: another than loopback when
    # learners run elsewhere (with learner_prefix: another network namespace, a container).
    host: str = "127.0.0.1"
    # A command each learner runs under, "{i}" its index: e.g. "taskset -c {i}" to give each its
    # core, or "ip netns exec ns{i}" to put each on its own (emulated) machine.
    learner_prefix: str = ""
    # Every chunk made into a shard before the first learner starts (no bound on ready shards):
    # on one machine the learners then have its cores to themselves (diloco.local.prepared).
    prepare_first: bool = False

    def __post_init__(self) -> None:
        """Refused here, in one line naming the flag, whoever builds the options (the CLI, a script):
        a negative chaos interval once killed a process every 0.5 s."""
        if (
            self.learners < 1
            or self.data_workers < 1
            or not self.learner_ranks
            or min(self.learner_ranks) < 1
        ):
            raise DilocoError("--learners, --learner-ranks and --data-workers must be at least 1")
        if not self.chaos_interval >= 0:
            raise DilocoError(f"--chaos-interval must be >= 0 (0: no chaos), got {self.chaos_interval}")
        if unknown := set(self.chaos_roles) - set(KILLABLE_ROLES):
            raise DilocoError(
                f"--chaos-roles: unknown role(s) {', '.join(sorted(unknown))} (roles: {', '.join(KILLABLE_ROLES)})"
            )
        if self.data_parallel not in ("ddp", "fsdp"):
            raise DilocoError(f"--data-parallel must be ddp or fsdp, not {self.data_parallel!r}")
        if not self.slow_learner >= 1:
            raise DilocoError(f"--slow-learner must be >= 1 (1: none slower), got {self.slow_learner}")
        if not self.minutes >= 0 or self.tokens < 0:
            raise DilocoError("--minutes and --tokens must be >= 0")

    def ranks_of(self, learner: int) -> int:
        return self.learner_ranks[min(learner, len(self.learner_ranks) - 1)] if self.learner_ranks else 1

    def job_config(self, name: str) -> RunConfig:
        """The configuration the job's processes run: the options' config with what this machine
        and these flags decide where the config left it open."""
        cfg = self.config
        if cfg.train.threads == 0:
            # Learners (and their ranks) split the machine's cores instead of each taking all of them.
            ranks = sum(self.ranks_of(i) for i in range(self.learners))
            cfg = cfg.with_overrides({"train.threads": max(1, (os.cpu_count() or 1) // ranks)})
        if self.tokens:
            cfg = cfg.with_overrides({"train.max_tokens": self.tokens})
        if cfg.data.deal == 0:  # one deal slot per learner: a fault-free run repeats exactly
            cfg = cfg.with_overrides({"data.deal": self.learners})
        if cfg.data.max_ready_shards == 0 and not self.prepare_first:
            # Data workers share the learners' cores here: make a few shards per learner ahead,
            # not the whole corpus at the start.
            cfg = cfg.with_overrides({"data.max_ready_shards": 2 * self.learners})
        return cfg.with_overrides({"name": name}).validate()
