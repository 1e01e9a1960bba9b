"""Pushes: a learner's fragment delta streamed in, checked, accepted into its round and folded."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import grpc
import torch

from diloco.coordinator import limits, merging, syncer
from diloco.coordinator.callers import caller_of
from diloco.coordinator.ledger.claims import Claim
from diloco.coordinator.ledger.db import DROPPED_BY_RESTART
from diloco.coordinator.ledger.rows import PushRecorded
from diloco.coordinator.log_text import loggable
from diloco.coordinator.service.push_intake import PushIntake, Screened
from diloco.coordinator.service.state import (
    PUSH_HEADER_WAIT_S,
    PUSH_SLOT_WAIT_S,
    PendingPush,
    RoundSum,
    log,
    moving_average,
    stream_header,
)
from diloco.coordinator.stream_watch import StreamLimits, StreamWatch
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.codecs import CodecError
from diloco.wire.tensors import WireError


class PushRPCs(PushIntake):
    def PushDelta(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.PushReply:
        # One caller has at most max_pushes_per_caller pushes open, waiting or in a slot: pushes
        # that stall cannot take every slot (nor every handler thread waiting for one).
        caller = caller_of(context)
        if problem := self.callers.open("push", caller, self.config.coordinator.max_pushes_per_caller):
            self.ledger.bump("pushes_deferred")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)
        try:
            return self._push_in_slot(request_iterator, context)
        finally:
            self.callers.close("push", caller)

    def _push_in_slot(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.PushReply:
        self.wire.call("push")  # its messages are counted as gRPC reads them (CountRequestStreams)
        started = time.monotonic()
        c = self.config.coordinator

        def cancel(reason: str) -> None:
            log.warning("push stream stalled, cancelled: %s", reason)
            self.metrics.refused("stalled stream")
            context.cancel()  # the handler's next read raises; its slot is released below

        # The header first, within a short deadline, and checked before any slot is taken: a
        # stream that sends nothing (or a header that is refused) holds no slot.
        wait = min(PUSH_HEADER_WAIT_S, c.push_idle_s)
        with StreamWatch(StreamLimits(wait, wait, c.push_min_bytes_per_s), cancel):
            first, messages = stream_header(request_iterator, context, "push stream must start with a header")
        header = first.header
        claim = self._check_header(header, context)
        # At most max_inflight_pushes deltas are held at once; the rest are told to come back
        # (clients retry RESOURCE_EXHAUSTED with backoff), so memory does not grow with learners.
        if not self._push_slots.acquire(timeout=PUSH_SLOT_WAIT_S):
            self.ledger.bump("pushes_deferred")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many pushes in flight; retry shortly")
        try:
            with StreamWatch(
                StreamLimits(c.push_idle_s, c.push_base_s, c.push_min_bytes_per_s), cancel
            ) as watch:
                watch.declared_bytes = sum(math.prod(s.shape) * 4 for s in header.tensors)  # fp32 at most
                reply = self._push_delta(header, claim, watch.messages(messages), context)
        finally:
            self._push_slots.release()
        self.metrics.push_seconds.observe(time.monotonic() - started)
        if not reply.accepted:
            self.metrics.refused(reply.reason)
        return reply

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, worker_id: str, why: str) -> None:
        self.ledger.bump("pushes_refused")
        self.metrics.refused(why)
        log.warning("push refused worker=%s: %s", worker_id, why)
        context.abort(code, f"push refused: {why}")

    def _check_header(self, header: pb.TensorHeader, context: grpc.ServicerContext) -> Claim | None:
        """A push's header checked before its delta is read (worker, fragment, codec, bounds, and
        the rows it names: ledger.push_claim); the steps and tokens it is credited with, or None
        for a push the ledger knows (a retry: answered again) or an empty one."""
        self._require_worker(header.worker_id, context, "PushDelta")
        if not header.push_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push_id is required")
        if not self.fragments:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no parameters yet")
        if header.fragment >= len(self.fragments):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment {header.fragment}")
        prior = self.ledger.push_state(header.push_id)
        if prior is not None and prior["reason"] != DROPPED_BY_RESTART:
            return None  # a retry after a lost reply: answered in _push_delta, nothing checked again
        codec = header.codec or "fp32"
        if codec != self.config.sync.codec:
            self.ledger.bump("pushes_malformed")
            self.metrics.refused("malformed: wrong codec")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"push uses codec {codec!r} but this run is configured for {self.config.sync.codec!r}",
            )
        if header.tokens == 0 and not header.tensors:
            return None
        if problem := limits.push_problem(header, self.config):
            self.ledger.bump("pushes_malformed")
            self.metrics.refused("malformed: out of bounds")
            log.warning("push refused worker=%s: %s", header.worker_id, problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {problem}")
        spans = [(s.shard_id, s.row_start, s.row_end) for s in header.spans]
        claim = self.ledger.push_claim(
            header.worker_id, header.fragment, header.push_id, spans, header.inner_steps, header.tokens,
            self.config.train.batch_size, len(self.fragments), self.config.train.inner_steps,
        )  # fmt: skip
        if claim.refusal:
            code = grpc.StatusCode.PERMISSION_DENIED if claim.denied else grpc.StatusCode.INVALID_ARGUMENT
            self._refuse(context, code, header.worker_id, claim.refusal)
        return claim

    def _push_delta(
        self,
        header: pb.TensorHeader,
        claim: Claim | None,
        messages: Iterator[pb.TensorStreamMessage],
        context: grpc.ServicerContext,
    ) -> pb.PushReply:
        prior = self.ledger.push_state(header.push_id)
        if prior is not None and prior["reason"] == DROPPED_BY_RESTART:
            # Sent again after our restart dropped its round: the delta is whole (it is streamed
            # in full again), so it is taken afresh instead of throwing the learner's work away.
            log.info("push %s of %s: dropped by a restart, taken again", header.push_id[:8], header.worker_id)
            prior = None
        if prior is not None:  # a retry after a lost reply: answer again, change nothing
            for _ in messages:
                pass
            reply = self._known_push_reply(header)
            self.wire.add_out("push", reply)
            return reply

        if claim is not None and claim.rows_only:
            for _ in messages:  # read, not decoded: it merges nothing
                pass
            with self.cond:
                reply = self._accept_rows_only(header)
                self.cond.notify_all()
            reply.run_state = self._state_pb()
            self.wire.add_out("push", reply)
            return reply

        frag = self.fragments[header.fragment]
        empty = header.tokens == 0 and not header.tensors
        tensors: dict[str, torch.Tensor] = {}
        squared: float | None = None
        if not empty:
            try:
                tensors, squared = self._receive_delta(header, frag.names, header.codec or "fp32", messages)
            except (WireError, CodecError) as e:
                self.ledger.bump("pushes_malformed")
                self.metrics.refused("malformed")
                log.warning("push refused worker=%s: %s", header.worker_id, loggable(str(e)))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {e}")
            if header.tokens == 0 or header.inner_steps == 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a delta must report its steps and tokens")
            for name in self.averaged.intersection(tensors):
                if problem := limits.running_stats_problem(name, tensors[name], frag.params[name]):
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, header.worker_id, problem)
        else:
            for _ in messages:
                pass
        if claim is not None and (claim.steps, claim.tokens) != (header.inner_steps, header.tokens):
            log.info(
                "push %s of %s credited %d steps and %d tokens (it said %d and %d): what its rows hold",
                header.push_id[:8], header.worker_id, claim.steps, claim.tokens, header.inner_steps, header.tokens,
            )  # fmt: skip
            header.inner_steps, header.tokens = claim.steps, claim.tokens

        screened = self._screen(header, tensors, squared, frag) if tensors else Screened()
        norm_per_h = screened.norm_per_h
        with self.cond:
            reply, fold = self._accept_push(
                header, tensors, empty, screened.refusal, norm_per_h, screened.watched
            )
            # Only deltas of H steps or more make the history: a fragment's first push under the
            # streaming stagger holds H/P steps at the start of the warm-up, and compared with it
            # the next round's honest pushes stood at 4.8-6.9x (benchmarks/norm_ratios.py).
            if fold is not None and norm_per_h > 0 and header.inner_steps >= self.config.train.inner_steps:
                frag.recent_norms.append(norm_per_h)
                frag.recent_workers.append(header.worker_id)
                deviation = screened.deviation_per_h
                frag.recent_deviations.append(norm_per_h if deviation is None else deviation)
            self.cond.notify_all()  # the merger decides; pushes that come while it merges join the next round
        if fold is not None:
            if screened.kept < 1:
                self._center(header, tensors, screened)
            self._fold(header, tensors, *fold)
        # Learners push every H/P steps but heartbeat every few seconds: told here, they stop
        # within a push interval of the budget instead of training on for a heartbeat period.
        reply.run_state = self._state_pb()
        self.wire.add_out("push", reply)
        return reply

    def _fold(
        self,
        header: pb.TensorHeader,
        tensors: dict[str, torch.Tensor],
        into: RoundSum,
        weight: float,
        age: float,
    ) -> None:
        """Add an accepted push into its round's sum, outside the service lock (pushes fold in
        parallel with each other and with receiving); the merger waits for every fold of a round."""
        try:
            with into.lock:
                into.acc.add(tensors, weight, consume=True, age=age)
        except Exception:  # recorded as pending, not in the sum: the merge must drop it, not count it
            log.exception("folding push %s failed; it will be dropped", header.push_id)
            into.lost.append(header.push_id)
        finally:
            with self.cond:
                into.folding -= 1
                self.cond.notify_all()

    def _known_push_reply(self, header: pb.TensorHeader) -> pb.PushReply:
        """The answer to a push the ledger holds already (a retry after a lost reply, a copy sent
        again while the first still streamed, or a learner asking again after our restart). A
        merged push answers with the version just before its merge, so the learner's "newer than"
        pull returns the merge that holds it at once.

        Read under the lock the merger and the publisher hold, so a merge is either unpublished
        (in memory) or committed to the ledger, never neither. Read apart, a publish between the
        two reads answered a merged push with its own merge's version; the learner then waited for
        a later merge that never came (a chaos test's run ended 2 minutes late, in its final
        flush's two 60-s waits)."""
        with self.cond:
            prior = self.ledger.push_state(header.push_id)
            merged_at = prior["merged_version"] or self._unpublished_merge_of(header.fragment, header.push_id)
            current = self.fragments[header.fragment].version
        return pb.PushReply(
            accepted=prior["state"] != "dropped",
            reason=prior["reason"] or f"already received ({prior['state']})",
            version=merged_at - 1 if merged_at else current,
        )

    def _record_push(
        self,
        header: pb.TensorHeader,
        spans: list[tuple[int, int, int]],
        released: list[int],
        stale: str | None,
        norm: float | None = None,
        watched: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None),
    ) -> str | None:
        """The push in the ledger, pending or (stale) dropped, with what the pusher watch saw of
        it; the ledger's refusal, or None."""
        return self.ledger.record_push(
            header.push_id,
            header.worker_id,
            header.fragment,
            header.version,
            header.inner_steps,
            header.tokens,
            spans,
            released,
            state="dropped" if stale else "pending",
            reason=stale or "",
            norm=norm or None,
            watched=watched,
        )

    def _nothing_this_round(self, header: pb.TensorHeader) -> None:
        """The pusher's word that it has nothing for its fragment's open round (lock held): it
        counts for closing the round, and merges nothing."""
        arrivals = self.fragments[header.fragment].round.arrivals
        arrivals[:] = [a for a in arrivals if not (a.worker_id == header.worker_id and a.tokens == 0)]
        arrivals.append(syncer.Arrival(header.worker_id, 0, 0, self.clock(), header.version))

    def _accept_rows_only(self, header: pb.TensorHeader) -> pb.PushReply:
        """Record a push taken for its rows only (lock held): its rows merged at the current
        version, its delta not. It counts for closing its round as a "nothing this round" push
        does, and is answered as a push merged into the current version is (the learner takes
        that version at once, as after any merge)."""
        frag = self.fragments[header.fragment]
        while frag.sealing:
            self.cond.wait(0.05)
        spans = [(s.shard_id, s.row_start, s.row_end) for s in header.spans]
        try:
            refusal = self.ledger.record_rows_only(
                header.push_id, header.worker_id, header.fragment, header.version, spans,
                list(header.released_shards), frag.version,
            )  # fmt: skip
        except PushRecorded:
            return self._known_push_reply(header)
        if refusal is not None:
            log.info("push refused worker=%s fragment=%d: %s", header.worker_id, header.fragment, refusal)
            return pb.PushReply(accepted=False, reason=refusal, version=frag.version)
        log.info(
            "push %s of %s taken for its rows only: no credit left for its delta",
            header.push_id[:8], header.worker_id,
        )  # fmt: skip
        self._nothing_this_round(header)
        return pb.PushReply(
            accepted=True, reason="rows recorded: no credit left for this delta", version=frag.version - 1
        )

    def _accept_push(
        self,
        header: pb.TensorHeader,
        tensors: dict[str, torch.Tensor],
        empty: bool,
        refuse: str = "",
        norm: float = 0.0,
        watched: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None),
    ) -> tuple[pb.PushReply, tuple[RoundSum, float, float] | None]:
        """Record a push in its round (lock held); returns the reply, and for a delta to merge,
        the round's sum to fold it into with its weight and its age factor."""
        frag = self.fragments[header.fragment]
        while frag.sealing:  # the merger is closing this round: join the next one
            self.cond.wait(0.05)
        released = list(header.released_shards)
        if empty and header.release_only:
            # Leases given back, and no word about the round: the learner's delta is still to come.
            self.ledger.release_shards(header.worker_id, released)
            return pb.PushReply(accepted=True, reason="shards released", version=frag.version), None
        if empty:
            # "Nothing this round" (a learner waiting for data): counts for closing, merges nothing.
            self.ledger.release_shards(header.worker_id, released)
            self._nothing_this_round(header)
            return pb.PushReply(accepted=True, reason="nothing to merge", version=frag.version), None
        spans = [(s.shard_id, s.row_start, s.row_end) for s in header.spans]
        stale = (
            syncer.staleness_refusal(self.policy.max_staleness, header.version, frag.version)
            or refuse
            or None
        )
        # A stale push is recorded too (dropped, with its reason): a retry of it gets the same answer.
        try:
            refusal = self._record_push(header, spans, released, stale, norm, watched) or stale
        except PushRecorded:
            # Another copy of this push (a client's retry while the first still streamed) was
            # recorded after this one read "not recorded": answered as any retry is.
            return self._known_push_reply(header), None
        if refusal is not None:
            log.info("push refused worker=%s fragment=%d: %s", header.worker_id, header.fragment, refusal)
            return pb.PushReply(accepted=False, reason=refusal, version=frag.version), None
        now = self.clock()
        missed = 0.0
        others = [a for a in frag.round.arrivals if a.tokens and a.worker_id != header.worker_id]
        opens = not any(a.tokens for a in frag.round.arrivals)
        if opens:
            # Whose share the merge is: a learner that leaves before the round closes (its run
            # finishing, its heartbeats gone) does not make the others' pushes a larger share.
            frag.round.members = frozenset(self._merging_learners()) | {header.worker_id}
        if others:  # joining a round another learner opened: late for it?
            first = min(others, key=lambda a: a.arrived_at)
            missed = syncer.late_in_round_by(now, first, header.step_time_s, self.config.sync.gather_steps)
        elif frag.previous_round is not None and opens:
            missed = syncer.missed_round_by(
                now,
                *frag.previous_round,
                header.worker_id,
                self.config.train.inner_steps * header.step_time_s,
            )
        arrival = syncer.Arrival(
            header.worker_id, header.tokens, header.inner_steps, now, header.version, header.step_time_s
        )
        frag.round.arrivals.append(arrival)
        frag.pending.append(PendingPush(arrival, header.push_id, header.mean_loss, header.first_loss))
        frag.sum.folding += 1
        if header.step_time_s > 0:
            self.step_time_s = moving_average(self.step_time_s, header.step_time_s)
        if header.first_loss and self.ledger.get_meta("first_loss") is None:
            self.ledger.set_meta(first_loss=repr(header.first_loss))
        weight = merging.merge_weight(header.tokens, header.inner_steps, self.policy.merge)
        age = merging.age_factor(self.policy.stale_decay, frag.version - header.version)
        reply = pb.PushReply(
            accepted=True, reason="queued for merge", version=frag.version, missed_round_by_s=missed
        )
        return reply, (frag.sum, weight, age)
