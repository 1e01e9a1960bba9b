"""The learner's heartbeat: what it reports, and what it does with the reply (the run finishing, a
restarted coordinator, lost shard leases, and its allowance of a Decoupled run's token budget).

Mixed into the Learner (diloco.compute.learner). The budget's decisions are pure functions:
lifecycle.training_allowance on the coordinator, schedule.budget_spent here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from diloco.client import CoordinatorClient
from diloco.compute import schedule
from diloco.compute.held import HeldFragment
from diloco.compute.prefetch import ShardPrefetcher
from diloco.compute.progress import Progress
from diloco.compute.rows import RowBook, span_tokens
from diloco.compute.sync_channel import SyncChannel
from diloco.errors import DilocoError
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")

ALLOWANCE_ASK_S = 0.5  # a learner waiting for budget asks this often, not every heartbeat_s


class Heartbeats:
    """What the heartbeat reads and changes of the Learner (declared here)."""

    client: CoordinatorClient
    frags: list[HeldFragment]
    rows: RowBook
    row_tokens: dict[int, int]
    progress: Progress
    prefetcher: ShardPrefetcher
    channel: SyncChannel
    stop: threading.Event
    finishing: threading.Event
    epoch: int
    allowance: tuple[int, int] | None
    # Whether a heartbeat has answered with this life's allowance yet (the learner starts at none).
    allowance_told: bool = False
    _allowance_asked_at: float = 0.0
    _asked_at_tokens: int = -1  # tokens_trained when the training loop last asked for an allowance

    _on_starved: Callable[[float], float]

    def _unmerged_spans(self) -> list[tuple[int, int, int]]:
        """Rows trained that no merge this learner took counts yet: in its row book, or named by a
        push in flight. (Read from other threads: the lists are copied as they stand.)"""
        # Each push read once: the training thread may set it to None between two reads.
        pushes = [f.push for f in list(self.frags) if f.in_flight]
        in_flight = [(s.shard_id, s.row_start, s.row_end) for push in pushes if push for s in push[0].spans]
        return self.rows.spans() + in_flight

    def _tokens_unmerged(self) -> int:
        """This learner's claim on the budget: rows trained that no merge it took counts yet."""
        return span_tokens(self._unmerged_spans(), self.row_tokens)

    def _heartbeat(self) -> None:
        request = self.progress.heartbeat(self.prefetcher.held_shards())
        request.tokens_unmerged = self._tokens_unmerged()
        self.client.pull_clock.report(request)
        reply = self.client.heartbeat(request)
        allowed = reply.tokens_allowed if reply.HasField("tokens_allowed") else None
        self.allowance = None if allowed is None else (request.tokens_trained, allowed)
        self.allowance_told = True
        if reply.run_state in (pb.RUN_STATE_FINISHING, pb.RUN_STATE_FINISHED):
            self.finishing.set()
        if reply.coordinator_epoch != self.epoch:
            log.warning("coordinator epoch %d -> %d: it restarted", self.epoch, reply.coordinator_epoch)
            self.epoch = reply.coordinator_epoch
            self.channel.coordinator_restarted()
        for shard_id in reply.lost_shard_leases:
            log.warning("lease on shard %d lost", shard_id)
            self.prefetcher.lose(shard_id)

    def _wait_for_allowance(self, last_empty_push: float) -> float:
        """The token budget is all claimed (schedule.budget_spent): ask once more at once, then hand
        in, as a starved learner does, so the claimed rows merge, and ask for a new allowance
        sooner than the next heartbeat. Returns when the last empty push was sent."""
        since = time.monotonic()
        # Just ran out: ask before handing in. The allowance was cut against the others' claims as
        # estimated then; told now, with this learner's count fresh, the last slice (a step or
        # two) comes without a hand-in's round trip. (Measured: after every learner handed in, the
        # merges left the budget 720 tokens short, and the last step waited a second round trip.)
        if self.allowance_told and self.progress.tokens_trained != self._asked_at_tokens:
            self._ask_for_allowance(since)
            if not schedule.budget_spent(self.progress.tokens_trained, self.allowance):
                self.progress.budget_waited(since, time.monotonic())
                return last_empty_push
        # Before the first answer nothing is spent: only asked. A resumed learner holds its last
        # life's unpushed steps, and handed in then, each fragment's push closed a round of its
        # own at coverage 1/M, and the other learners' next pushes were a version stale (measured:
        # the worst of the 8 chaos pairs, 3% worse than its twin, held two such hand-ins).
        if self.allowance_told:
            last_empty_push = self._on_starved(last_empty_push)  # also takes the merges that arrived
        now = time.monotonic()
        if now - self._allowance_asked_at >= ALLOWANCE_ASK_S:
            self._ask_for_allowance(now)
        else:
            self.stop.wait(0.05)
        self.progress.budget_waited(since, time.monotonic())
        return last_empty_push

    def _ask_for_allowance(self, now: float) -> None:
        self._allowance_asked_at, self._asked_at_tokens = now, self.progress.tokens_trained
        with contextlib.suppress(grpc.RpcError, DilocoError):  # the heartbeat thread reports an outage
            self._heartbeat()
