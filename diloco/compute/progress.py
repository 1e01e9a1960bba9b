"""What a learner has done so far: its counters, reported in heartbeats (utilization and goodput
are computed from them)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from diloco.compute.mfu import mfu
from diloco.coordinator.limits import MAX_METRICS, MAX_NAME_BYTES
from diloco.v1 import coordinator_pb2 as pb


@dataclass
class Progress:
    inner_steps: int = 0  # the learner's step count: a resume restores it from local state
    life_steps: int = 0  # the steps of this process, the ones busy_s timed
    tokens_trained: int = 0
    last_loss: float = math.nan
    first_loss: float = math.nan
    busy_s: float = 0.0  # time inside inner steps
    kept_busy_s: float = 0.0  # of it, the steps a kill would not lose (pushed, or saved locally)
    resumed_kept_busy_s: float = 0.0  # the previous life's kept_busy_s in the state it resumed
    stall_s: float = 0.0  # time waiting for data
    sync_wait_s: float = 0.0  # time waiting for the syncer
    # Time with its allowance of the token budget spent (schedule.budget_spent), in two parts:
    # the waits that more steps followed, inside the training wall (the run's end game handing
    # out the budget's last tokens), and those since the last step (the last wait is not in it).
    held_back_s: float = 0.0
    waiting_s: float = 0.0
    # When its allowance ran out, while no step came after: a loop that ends then ended its
    # training there (the run's last merges are the others' end game, as the final flush is).
    spent_at: float | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None  # the training loop's end: the final flush is not training time
    # The process's CPU time (every thread: pushes, pulls and prefetching too) at the same marks.
    cpu_started: float = field(default_factory=time.process_time)
    cpu_ended: float | None = None
    # The forward's metrics summed over the steps since the last heartbeat, and those steps.
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_steps: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    device: str = ""  # where the learner computes, once it knows
    ranks: int = 1  # processes in this learner (a torchrun group)
    replica_checks: int = 0  # merges after which the ranks' replicas were compared equal
    # For MFU: the model's parameters and one rank's peak FLOP/s (0: unknown, MFU not reported).
    params: int = 0
    peak_flops: float = 0.0

    @property
    def budget_wait_s(self) -> float:
        return self.held_back_s + self.waiting_s

    def wall_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def cpu_s(self) -> float:
        return (self.cpu_ended if self.cpu_ended is not None else time.process_time()) - self.cpu_started

    def start(self) -> None:
        """Training time (and the CPU it takes) counts from now."""
        self.started, self.cpu_started = time.monotonic(), time.process_time()

    def end(self, now: float) -> None:
        """The training loop ended: at `now`, or when the allowance it waited on since ran out.
        A wait that more steps followed is held-back time, and stays in the wall."""
        self.ended = self.spent_at if self.spent_at is not None else now
        self.cpu_ended = time.process_time()  # an idle wait for the allowance used next to none

    def budget_waited(self, since: float, now: float) -> None:
        """Time waiting for an allowance of the token budget (schedule.budget_spent)."""
        self.waiting_s += now - since
        if self.spent_at is None:
            self.spent_at = since

    def stepped(
        self, busy_s: float, tokens: int, loss: float, metrics: dict[str, float] | None = None
    ) -> None:
        """One inner step done, with the metrics its forward returned."""
        if metrics:
            for name, value in metrics.items():
                # What the coordinator takes (limits.heartbeat_problem): 32 short names, finite values.
                if name in self.metric_sums or (
                    len(self.metric_sums) < MAX_METRICS and len(name.encode()) <= MAX_NAME_BYTES
                ):
                    self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value
            self.metric_steps += 1
        self.busy_s += busy_s
        self.held_back_s += self.waiting_s  # a step came after those waits
        self.spent_at, self.waiting_s = None, 0.0
        self.inner_steps += 1
        self.life_steps += 1
        self.tokens_trained += tokens
        self.last_loss = loss
        if math.isnan(self.first_loss):
            self.first_loss = loss

    def tokens_per_s(self) -> float:
        """Tokens over time inside inner steps: the learner's own speed, data stalls aside."""
        return self.tokens_trained / self.busy_s if self.busy_s else 0.0

    def mfu(self) -> float:
        return mfu(self.tokens_per_s(), self.params, self.peak_flops, self.ranks)

    def step_time_s(self) -> float:
        # Over this life's steps: after a resume, inner_steps counts the earlier lives' steps too,
        # and the step time (the syncer's grace window, the catch-up) would come out too short.
        return self.busy_s / max(1, self.life_steps)

    def train_metrics(self) -> dict[str, float]:
        """The metrics' means since the last call (a heartbeat), then start again; the last means
        when no step was taken since."""
        if self.metric_steps:
            self.last_metrics = {
                name: total / self.metric_steps
                for name, total in self.metric_sums.items()
                if math.isfinite(total)
            }
            self.metric_sums, self.metric_steps = {}, 0
        return self.last_metrics

    def heartbeat(self, shard_leases: list[int]) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(
            train_metrics=self.train_metrics(),
            shard_leases=shard_leases,
            inner_steps=self.inner_steps,
            tokens_trained=self.tokens_trained,
            last_loss=0.0 if math.isnan(self.last_loss) else self.last_loss,
            busy_seconds=self.busy_s,
            kept_busy_seconds=self.kept_busy_s,
            resumed_kept_busy_seconds=self.resumed_kept_busy_s,
            wall_seconds=self.wall_s(),
            cpu_seconds=self.cpu_s(),
            data_stall_seconds=self.stall_s,
            sync_wait_seconds=self.sync_wait_s,
            budget_wait_seconds=self.held_back_s,
            device=self.device,
            ranks=self.ranks,
            mfu=self.mfu(),
        )

    def summary(self) -> str:
        group = (
            f" ranks={self.ranks} replicas equal after {self.replica_checks} merges" if self.ranks > 1 else ""
        )
        return (
            f"steps={self.inner_steps} tokens={self.tokens_trained} busy={self.busy_s:.1f}s "
            f"wall={self.wall_s():.1f}s data stall={self.stall_s:.1f}s sync wait={self.sync_wait_s:.1f}s"
            f" budget wait={self.budget_wait_s:.1f}s ({self.held_back_s:.1f}s of it held back)"
            f"{group}"
        )
