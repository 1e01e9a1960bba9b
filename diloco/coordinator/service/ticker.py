"""The syncer's clock: what time drives (lease expiry, the token budget and the run's end, workers
gone long, the run's rates sampled as events), on a thread of its own every TICK_S."""

from __future__ import annotations

import time

from diloco.coordinator import lifecycle
from diloco.coordinator.ledger.workers import Reclaimed
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import log
from diloco.coordinator.stall import TICK_S, own_stall_s

# How often the run's rates are sampled as a "progress" event (curves of the page, TensorBoard).
PROGRESS_EVERY_S = 5.0

# How often workers gone long and named nowhere are looked for (coordinator.forget_workers_after_s).
FORGET_EVERY_S = 60.0


class Ticker(ServiceBase):
    def _tick_forever(self) -> None:
        """Time-driven events: lease expiry, the token budget, the end of the run. (Grace windows
        and learners found dead close rounds in the merger, which wakes at least every 0.25 s.)"""
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # a bad tick must not kill the syncer; it is logged and retried
                log.exception("syncer tick failed")
            self._ticked_at = time.monotonic()

    def tick(self) -> None:
        self._sample_progress(time.monotonic())
        stall, why = own_stall_s(self._ticked_at, time.monotonic())
        if stall:  # before anything expires: the silence was ours
            log.warning("%s", why)
            self.ledger.extend_deadlines(stall)
        ttl = self.config.coordinator.lease_ttl_s
        self._say_reclaimed(self.ledger.reclaim_expired(ttl, self.config.coordinator.max_chunk_attempts), ttl)
        gone_s = self.config.coordinator.forget_workers_after_s
        if gone_s > 0 and time.monotonic() - self._forgot_at >= FORGET_EVERY_S:
            self._forgot_at = time.monotonic()
            if forgotten := self.ledger.forget_idle(gone_s):
                log.info(
                    "forgot %d workers gone over %.0f s that left nothing in the ledger", forgotten, gone_s
                )
        for _ in range(2):  # running → finishing → finished may both happen in one tick
            with self.cond:
                unpublished = any(f.pending or f.unpublished for f in self.fragments)
            change = lifecycle.next_run_state(
                self.run_state,
                tokens_merged=int(self.ledger.counter("tokens_merged")),
                budget=self.config.train.max_tokens,
                # A ledger query: asked only where the answer matters (a finishing run).
                live_learners=len(self._live_learners()) if self.run_state == lifecycle.FINISHING else 0,
                work_unpublished=unpublished,
                data_exhausted=self.run_state == lifecycle.RUNNING and self.ledger.train_data_exhausted(),
            )
            if change.state is None:
                return
            self._set_run_state(change.state, change.reason)

    def _say_reclaimed(self, reclaimed: Reclaimed, ttl_s: float) -> None:
        """A worker that went silent (killed, hung, cut off) and the leases that came back: in the
        log and metrics.jsonl, where an operator looks for what happened to it."""
        for worker_id, role in reclaimed.lost:
            log.warning("worker %s (%s) lost: no heartbeat for %.0f s", worker_id, role, ttl_s)
            self.events.record("lost", worker_id=worker_id, role=role)
        for kind, ids in (("chunk", reclaimed.chunks), ("shard", reclaimed.shards)):
            if ids:
                log.info("%s leases expired, back to the pool: %s", kind, ", ".join(map(str, ids)))
        if reclaimed.quarantined:
            log.warning("chunks quarantined, their leases expired too often: %s", reclaimed.quarantined)

    def _sample_progress(self, now: float) -> None:
        """Every PROGRESS_EVERY_S, the run's rates as an event: merged tokens/s, wire bytes per
        merged token (over the interval), learners alive."""
        last = self._progress_at
        if last is not None and now - last[0] < PROGRESS_EVERY_S:
            return
        merged = int(self.ledger.counter("tokens_merged"))
        wire = sum(self.wire.totals())
        self._progress_at = (now, merged, wire)
        self._save_counts()
        if last is None:
            return
        dt, dm, dw = now - last[0], merged - last[1], wire - last[2]
        self.events.record(
            "progress",
            tokens_merged=merged,
            wire_bytes=wire,  # (the events' window takes both rates over 30 s from the totals)
            merged_tokens_per_s=round(dm / dt, 1),
            wire_bytes_per_token=round(dw / dm, 1) if dm > 0 else None,
            learners_alive=len(self._live_learners()),
            run_state=self.run_state,
        )
