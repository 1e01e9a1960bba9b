"""The syncer's merger thread: rounds that are ready are sealed and merged (the outer step)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

from diloco.coordinator import merging, pusher_watch, syncer
from diloco.coordinator.ledger import MergeRecord
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    FragmentState,
    log,
    moving_average,
)
from diloco.wire.tensors import sq_norm

# The merger also wakes this often with nothing to wake it: a learner found dead is an event no
# RPC announces.
MERGER_POLL_S = 0.25


def wake_in(now: float, recheck_at: float | None, poll_s: float) -> float:
    """Seconds the merger sleeps: until the earliest grace window runs out, at most poll_s."""
    if recheck_at is None:
        return poll_s
    return min(poll_s, max(0.005, recheck_at - now))


class Merger(ServiceBase):
    def _merge_forever(self) -> None:
        """Close rounds as pushes arrive. One thread merges, so pushes that arrive while a merge
        runs wait in the next round and merge together: under load, one outer step takes many
        deltas instead of each push paying for its own."""
        with self.cond:
            while not self._stop.is_set():
                recheck_at = None
                try:
                    recheck_at = self._close_ready_rounds()
                except Exception:  # a bad merge must not stop the syncer; it is tried again
                    log.exception("merge failed")
                # Pushes, leaves and finishing wake it; a grace window wakes it when it runs out.
                self.cond.wait(wake_in(self.clock(), recheck_at, MERGER_POLL_S))

    def _close_ready_rounds(self) -> float | None:
        """Merge every fragment whose round the pure decision says is ready (lock held). Returns
        the earliest time a round still open may close with nothing else happening (None: none)."""
        if not self.fragments:
            return None
        live = self._merging_learners()
        now = self.clock()
        recheck: list[float] = []
        for frag in self.fragments:
            decision = syncer.decide_close(
                frag.round, now, self.policy, live, self.step_time_s, self.sync_time_s + self.publish_time_s,
                awaited=frag.awaited, awaited_until=frag.awaited_until,
            )  # fmt: skip
            if decision.close:
                self._merge(frag, decision.reason)
            elif decision.recheck_at is not None:
                recheck.append(decision.recheck_at)
        return min(recheck, default=None)

    def _merge(self, frag: FragmentState, reason: str) -> None:
        """Close frag's round (lock held): the outer step on what its pushes sum to, kept as the
        new head for the publisher, or the round refused with its reason."""
        if not frag.pending:  # only "nothing this round" arrivals: reopen, the version stays
            frag.round = syncer.RoundState(frag.round.fragment, frag.version, self.clock())
            return
        # Sealed until the head moves on: the round's last accepted pushes may still be adding into
        # the sum, and a push that comes now joins the next round (it waits, lock released).
        frag.sealing = True
        try:
            while frag.sum.folding:
                self.cond.wait(0.05)
            self._merge_sealed(frag, reason)
        finally:
            frag.sealing = False
            self.cond.notify_all()  # the publisher, and pushes waiting for the next round

    def _merge_sealed(self, frag: FragmentState, reason: str) -> None:
        p, pending, summed = frag.round.fragment, frag.pending, frag.sum
        started = time.monotonic()
        if summed.lost:
            # A fold that failed part-way leaves the sum untrusted: the whole round is dropped
            # (its rows go back to the pool), never merged short of a push it recorded.
            self.ledger.drop_pushes(
                [q.push_id for q in pending], "lost while merging; train those rows again"
            )
            frag.pending, frag.sum = [], self._new_sum()
            frag.round = syncer.RoundState(p, frag.version, self.clock())
            return
        contributors = {q.arrival.worker_id for q in pending}
        # The round's members count too. Measured (a chaos run, seed 5): a coordinator restart lost
        # a merged round, its push came again, and the other learner left (run finishing) before
        # it merged again: at coverage 1 and work 0.32, eval 2.310 -> 2.339; the same push merged
        # at 0.5 and 0.16, as the first time, gives 2.308 (recomputed from the checkpoints).
        # A learner refused while named (sync.refuse_suspects) is no share of it.
        refused = pusher_watch.refused(self.pusher_watch, self.config.sync.refuse_suspects)
        members = (set(self._live_learners()) | frag.round.members) - refused
        live = len(contributors | members)
        scale = merging.coverage_scale(len(contributors), live)
        steps = sum(q.arrival.steps for q in pending)
        # Short pushes are mostly the inner loop's fluctuation (merging.short_push_scale). A
        # fragment's first merge is plain averaging, every learner's start made one: never scaled.
        short = 1.0
        if frag.version > 0:
            short = merging.short_push_scale(
                [q.arrival.steps for q in pending],
                self.config.train.inner_steps,
                self.policy.short_push_scale,
            )
        work = merging.work_fraction(steps, live, self.config.train.inner_steps)
        hyper = merging.outer_hyper(
            self.policy.outer_lr, self.policy.outer_momentum, self.policy.outer_warmup_rounds, frag.version
        )
        # The arithmetic, with the service lock released: pushes to other fragments, pulls,
        # heartbeats and the publisher go on meanwhile (measured: the outer step held the lock
        # 70% of the time in benchmarks/ingest.py, and every other RPC queued behind it). The
        # seal keeps this round's pushes, sum and the head as they are: only this thread moves them.
        with self._lock_released():
            try:
                outer_grad = summed.acc.result(scale * short)
                params, momentum = merging.outer_step(
                    frag.params, frag.momentum, outer_grad, *hyper, self.policy.nesterov, fraction=work, consume=True,
                    averaged=self.averaged, share=scale * short,
                )  # fmt: skip
                # The parameters alone: a non-finite momentum makes a non-finite update, so parameters.
                finite = all(math.isfinite(sq_norm(t)) for t in params.values())
                failure = None
            except (RuntimeError, ValueError) as e:  # the sum is spent: the round cannot be tried again
                failure, finite = e, False
        if failure is not None:
            return self._refuse_round(
                frag, contributors, f"the merge failed ({failure}): the round was refused"
            )
        if not finite:
            # Every delta was finite, yet their merge is not: nothing changes, and the round's
            # pushes are refused (their rows go back to the pool) rather than poisoning the model.
            return self._refuse_round(
                frag, contributors, "the merged result is not finite: the round was refused"
            )
        version = frag.version + 1
        tokens = sum(q.arrival.tokens for q in pending)
        losses = [q.mean_loss for q in pending if q.mean_loss > 0]
        mean_loss = sum(losses) / len(losses) if losses else None
        frag.unpublished.append(
            MergeRecord(version, tuple(q.push_id for q in pending), tokens, steps, mean_loss, reason, scale)
        )
        frag.params, frag.momentum, frag.version = params, momentum, version
        frag.previous_round = (min(q.arrival.arrived_at for q in pending), frozenset(contributors))
        frag.pending, frag.sum = [], self._new_sum()
        frag.round = syncer.RoundState(p, version, self.clock())
        frag.awaited = frozenset()  # only the first round after a restart waits for re-sends
        if mean_loss is not None:
            self.last_loss = mean_loss
            if self.loss_scale is None:  # the scale the pusher watch measures learners' losses on
                self.loss_scale = mean_loss
        elapsed = time.monotonic() - started
        self.sync_time_s = moving_average(self.sync_time_s, elapsed)
        log.info(
            "merge fragment=%d version=%d pushes=%d steps=%d tokens=%d coverage=%.2f work=%.2f short=%.2f loss=%s (%s) in %.3fs",
            p,
            version,
            len(pending),
            steps,
            tokens,
            scale,
            work,
            short,
            f"{mean_loss:.4f}" if mean_loss else "-",
            reason,
            elapsed,
        )

    @contextlib.contextmanager
    def _lock_released(self) -> Iterator[None]:
        """The service lock let go for a while, by the merger that holds it (once: _merge_forever)."""
        self.cond.release()
        try:
            yield
        finally:
            self.cond.acquire()

    def _refuse_round(self, frag: FragmentState, contributors: set[str], why: str) -> None:
        """Drop a round whose merge cannot be made: its pushes refused with `why` (their rows go back
        to the pool), the fragment as it was, a fresh round open."""
        p = frag.round.fragment
        log.error("fragment %d: %s (pushes of %s)", p, why, sorted(contributors))
        self.ledger.drop_pushes([q.push_id for q in frag.pending], why)
        for _ in frag.pending:
            self.metrics.refused(why)
        self.events.record("merge_refused", fragment=p, version=frag.version, reason=why)
        frag.pending, frag.sum = [], self._new_sum()
        frag.round = syncer.RoundState(p, frag.version, self.clock())

    def _unpublished_merge_of(self, fragment: int, push_id: str) -> int | None:
        with self.cond:
            for merge in self.fragments[fragment].unpublished:
                if push_id in merge.push_ids:
                    return merge.version
        return None
