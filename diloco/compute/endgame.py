"""The learner's end game: work is handed in, never thrown away, when data runs out or the run ends.

Mixed into the Learner (diloco.compute.learner); the decisions are schedule.hand_in,
schedule.empty_push_due and schedule.loop_end, pure functions with tests of their own.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from diloco.client import CoordinatorClient
from diloco.compute import schedule
from diloco.compute.held import HeldFragment
from diloco.compute.prefetch import ShardPrefetcher
from diloco.compute.progress import Progress
from diloco.compute.rows import RowBook
from diloco.compute.state_writer import StateWriter
from diloco.compute.sync_channel import Merged, SyncChannel
from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")

FINAL_MERGE_WAIT_S = 60.0
FINAL_GIVE_BACK_WAIT_S = 10.0
EMPTY_PUSH_PERIOD_S = 2.0
# How long a learner must find no data before it pushes its steps off their schedule. A lease that
# says "none ready" for a moment (a data worker finishing the next shard, a restarted learner's
# first lease) is no reason: each such push closes a round of its own at coverage 1/M and leaves
# the others' next pushes a version stale (seen in a resumed learner's log: a hand-in 0.5 s into
# its life, its first batch 0.05 s later). Sustained starvation (the others hold the last shards)
# still hands in, so no learner sits on rows nobody else can merge.
STARVED_PATIENCE_S = 5.0
FINAL_CALL_TIMEOUT_S = 5.0


class EndGame:
    """What the end game reads and changes of the Learner (declared here)."""

    cfg: RunConfig
    frags: list[HeldFragment]
    rows: RowBook
    progress: Progress
    prefetcher: ShardPrefetcher
    channel: SyncChannel
    stop: threading.Event

    client: CoordinatorClient
    state_writer: StateWriter | None

    _push: Callable[..., None]  # (fragment, empty=False): queue a fragment's push
    _apply: Callable[[Merged], None]  # take a merged fragment

    def _take_arrived(self) -> None:
        """Apply every merged fragment that has arrived, whatever τ says (no steps are being taken)."""
        for p, f in enumerate(self.frags):
            merged = self.channel.take(p) if f.in_flight else None
            if merged is not None:
                self._apply(merged)

    def _wait_for_merges(self, timeout_s: float | None = None) -> None:
        """Block until every in-flight fragment is applied: synchronous mode, and the final flush."""
        started = time.monotonic()
        deadline = started + (timeout_s if timeout_s is not None else math.inf)
        while any(f.in_flight for f in self.frags) and not self.stop.is_set() and time.monotonic() < deadline:
            self._take_arrived()
            if any(f.in_flight for f in self.frags):
                self.channel.wait_any(0.2)
        self.progress.sync_wait_s += time.monotonic() - started

    def _hand_in(self) -> bool:
        """Push every fragment with unpushed steps (the unpushed rows ride along). False: none had any."""
        plan = schedule.hand_in(self.frags)
        if plan.push:
            log.info("handing in: %s", plan.reason)
            self.rows.hand_in()  # every row rides on the first of these pushes
        for p in plan.push:
            self._push(p)
        if plan.give_back:
            self._return_unpushed()
        return bool(plan.push)

    def _return_unpushed(self) -> None:
        """Give back rows whose effect no delta carries any more.

        Rows trained after a fragment's last push and before its merged value overwrote it leave
        no trace in any future delta when no fragment has steps left to push. They are not
        counted as trained-and-merged: the shards are released and those rows go back to the pool.
        """
        rows = self.rows.take_all()
        if not rows.spans:
            return
        header = pb.TensorHeader(fragment=0, version=max(0, self.frags[0].version), codec=self.cfg.sync.codec)
        header.released_shards.extend(rows.released)
        for shard_id in rows.released:
            self.prefetcher.release(shard_id)
        log.info("returning %d unmerged row span(s) to the pool", len(rows.spans))
        self.channel.submit(header, {})

    def _on_starved(self, last_empty_push: float, hand_in: bool = True) -> float:
        """No data anywhere for now: hand in finished work (when `hand_in`: see STARVED_PATIENCE_S),
        and let quorum rounds go on without us.

        Unpushed work holds shard leases (its rows are in no push yet): handing it in is what lets
        those rows be merged and the shards finish, so a starved learner never sits on them.
        Returns when the last empty push was sent.
        """
        self._take_arrived()  # no steps are taken while starved, so τ never runs out
        if not hand_in and schedule.hand_in(self.frags).push:
            return last_empty_push  # its steps wait for data, or for the patience to run out
        if self._hand_in():
            if self.cfg.sync.synchronous:
                self._wait_for_merges()
            return last_empty_push
        now = time.monotonic()
        if not schedule.empty_push_due(now, last_empty_push, EMPTY_PUSH_PERIOD_S):
            return last_empty_push
        for p, f in enumerate(self.frags):
            if not f.in_flight:
                self._push(p, empty=True)
        return now

    def _flush(self) -> None:
        """At the end: push every fragment's unpushed progress and wait (bounded) for the merges."""
        self._wait_for_merges(FINAL_MERGE_WAIT_S)
        self._hand_in()
        self._wait_for_merges(FINAL_MERGE_WAIT_S)
        self._return_unpushed()
        deadline = time.monotonic() + FINAL_GIVE_BACK_WAIT_S
        while not self.channel.idle() and time.monotonic() < deadline:  # the last give-back lands
            time.sleep(0.05)

    def _hand_in_and_leave(self, reason: str, heartbeats: threading.Thread) -> None:
        """Finished work is not thrown away: what was not pushed yet is pushed and merged. Then leave."""
        try:
            self.progress.end(time.monotonic())
            if not self.stop.is_set():
                self._flush()
                self.progress.kept_busy_s = self.progress.busy_s  # pushed and merged, or given back
                if self.state_writer is not None:
                    log.info("%s", self.state_writer.describe(self.progress.busy_s))
                    self.state_writer.discard()  # nothing is left to resume
        finally:
            self._leave(reason, heartbeats)
        log.info(
            "learner done (%s): %s refused=%d", reason, self.progress.summary(), self.channel.pushes_refused
        )
        cache = self.prefetcher.cache
        if cache is not None and (cache.stats.hits or cache.stats.misses):
            log.info("shard cache %s: %s", cache.directory, cache.stats.as_dict())

    def _leave(self, reason: str, heartbeats: threading.Thread) -> None:
        self.stop.set()
        if self.state_writer is not None:
            self.state_writer.close()
        # The final counters, for status and utilization: tried once, like leave(), so a
        # coordinator that is gone does not hold the exit up.
        try:
            final = self.client.pull_clock.report(self.progress.heartbeat(self.prefetcher.held_shards()))
            self.client.last_heartbeat(final, timeout_s=FINAL_CALL_TIMEOUT_S)
        except (grpc.RpcError, DilocoError):
            pass  # the coordinator is gone or busy: its counters miss this learner's last seconds
        except Exception:  # a defect here must not keep the learner from leaving: said, not raised
            log.exception("the final heartbeat could not be made")
        self.client.leave(reason)
        self.client.close()
        # A thread still inside gRPC or torch when the interpreter exits can abort the
        # process ("terminate called without an active exception"): wait for all of them.
        deadline = time.monotonic() + 10.0
        for thread in (self.channel, self.prefetcher, heartbeats):
            thread.join(max(0.0, deadline - time.monotonic()))
