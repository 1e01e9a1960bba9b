"""Join, Heartbeat, Leave: who is in the run."""

from __future__ import annotations

import logging
import math
import uuid

import grpc

from diloco.coordinator import lifecycle, limits
from diloco.coordinator.callers import Rates, caller_of, cert_caller, own_worker_id
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    ROLE_NAMES,
    log,
)
from diloco.v1 import coordinator_pb2 as pb

# A learner's allowance counts against the others for what it can train in this many heartbeats.
ALLOWANCE_HORIZON_HEARTBEATS = 2


def training_rate(stats: dict) -> float:
    """A learner's tokens per busy second, from its heartbeat stats (0: not known yet)."""
    busy = float(stats.get("busy_seconds", 0.0))
    return float(stats.get("tokens_trained", 0)) / busy if busy > 0 else 0.0


class MembershipRPCs(ServiceBase):
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        role = ROLE_NAMES.get(request.role)
        self.wire.unary_in("join", request, role)
        if role is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "join needs a role")
        caller = caller_of(context)
        # Under mutual TLS one certificate is one worker, its name: a join without an id once took
        # a fresh one each time, and one learner's certificate registered 64 learners.
        named = own_worker_id(caller)
        problem = (
            limits.id_problem(request.worker_id)
            or limits.id_problem(named, "certificate name")
            or limits.id_problem(request.host, "host")
            or limits.ranks_problem(request.ranks)
        )
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if named and request.worker_id not in ("", named):
            self._refuse_join(
                context, grpc.StatusCode.PERMISSION_DENIED, f"{named} may not join as {request.worker_id!r}"
            )
        worker_id = named or request.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
        c = self.config.coordinator
        if not self.ledger.known_worker(worker_id) and len(self.ledger.live_workers(role, c.lease_ttl_s)) >= (
            c.max_workers_per_role
        ):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{c.max_workers_per_role} live {role} workers already (coordinator.max_workers_per_role): join refused",
            )
        host = request.host or "?"
        if refusal := self.callers.join(
            worker_id, role, host, caller, c.max_workers_per_caller, c.lease_ttl_s
        ):
            self._refuse_join(context, refusal.code, refusal.why)  # RESOURCE_EXHAUSTED: retried
        self._roles[worker_id] = role
        log.info("join worker=%s role=%s host=%s ranks=%d", worker_id, role, host, max(1, request.ranks))
        self.events.record("join", worker_id=worker_id, role=role, host=host)
        reply = pb.JoinReply(
            worker_id=worker_id,
            config_json=self.config.to_json(),
            coordinator_epoch=self.epoch,
            needs_init=not self.fragments,
            num_fragments=self.config.sync.fragments,
            run_state=self._state_pb(),
            heartbeat_s=self.config.coordinator.heartbeat_s,
            tokenizer_hash=self.tokenizer_hash,
            run_id=self.run_id,
            fragment_versions=[f.version for f in self.fragments],
        )
        with self.cond:
            self.cond.notify_all()
        self.wire.add_out("join", reply, role)
        return reply

    def _refuse_join(self, context: grpc.ServicerContext, code: grpc.StatusCode, why: str) -> None:
        """A join the callers' rules refuse (callers.join_refusal): counted and logged as the guard's."""
        self.caller_refused("Join", why, context.peer())
        context.abort(code, why)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        role = self._role_of(request.worker_id)
        self.wire.unary_in("heartbeat", request, role)
        self._require_worker(request.worker_id, context, "Heartbeat")
        if problem := limits.heartbeat_problem(request):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad heartbeat: {problem}")
        told = self._allowed.get(request.worker_id)  # (a worker not answered yet is never too soon)
        if told is not None and self._heartbeats.take(request.worker_id, self.ledger.clock()):
            return self._heartbeat_too_soon(request, told, role)
        stats = {
            "inner_steps": request.inner_steps,
            "tokens_trained": request.tokens_trained,
            "last_loss": request.last_loss,
            "busy_seconds": request.busy_seconds,
            "kept_busy_seconds": request.kept_busy_seconds,
            "resumed_kept_busy_seconds": request.resumed_kept_busy_seconds,
            "wall_seconds": request.wall_seconds,
            "cpu_seconds": request.cpu_seconds,
            "data_stall_seconds": request.data_stall_seconds,
            "sync_wait_seconds": request.sync_wait_seconds,
            "budget_wait_seconds": request.budget_wait_seconds,
            "pull_seconds": request.pull_seconds,
            "pulled_fragments": request.pulled_fragments,
            "train_metrics": dict(request.train_metrics),
            **({"device": request.device} if request.device else {}),
            "ranks": max(1, request.ranks),
            **({"mfu": round(request.mfu, 4)} if request.mfu else {}),
        }
        ttl = self.config.coordinator.lease_ttl_s
        allowed = self._record_heartbeat(request, role, stats)
        if role == "compute" and request.wall_seconds > 0:
            self.events.record(
                "learner", worker_id=request.worker_id, inner_steps=request.inner_steps,
                tokens_trained=request.tokens_trained, loss=request.last_loss,
                utilization=round(request.busy_seconds / request.wall_seconds, 4),
                data_stall=round(request.data_stall_seconds / request.wall_seconds, 4),
                metrics=stats["train_metrics"], tokens_merged=int(self.ledger.counter("tokens_merged")),
            )  # fmt: skip
        lost_chunks, lost_shards = self.ledger.renew(
            request.worker_id, request.chunk_leases, request.shard_leases, ttl
        )
        reply = pb.HeartbeatReply(
            run_state=self._state_pb(),
            coordinator_epoch=self.epoch,
            lost_chunk_leases=lost_chunks,
            lost_shard_leases=lost_shards,
        )
        if allowed is not None:
            reply.tokens_allowed = allowed
        if len(self._allowed) >= Rates.MAX_KEYS and request.worker_id not in self._allowed:
            self._allowed.clear()  # (each worker's next heartbeat is then answered in full)
        self._allowed[request.worker_id] = (request.tokens_trained, allowed)
        self.wire.add_out("heartbeat", reply, role)
        return reply

    def _heartbeat_too_soon(
        self, request: pb.HeartbeatRequest, told: tuple[int, int | None], role: str | None
    ) -> pb.HeartbeatReply:
        """A heartbeat faster than its worker's rate: the run's state and what is left of the last
        allowance, with no ledger write (its stats, leases and claim wait for the next in time)."""
        reply = pb.HeartbeatReply(run_state=self._state_pb(), coordinator_epoch=self.epoch)
        trained_then, allowed = told
        if allowed is not None:  # the learner counts an allowance from the tokens it reports now
            reply.tokens_allowed = max(0, allowed - max(0, request.tokens_trained - trained_then))
        self.wire.add_out("heartbeat", reply, role)
        return reply

    def _record_heartbeat(self, request: pb.HeartbeatRequest, role: str | None, stats: dict) -> int | None:
        """Keep the worker's stats; for a learner of a budgeted Decoupled run, also its claim on the
        budget and the allowance it gets now (lifecycle.training_allowance). Synchronous learners
        stop at their share of the budget themselves (schedule.token_share)."""
        budget = self.config.train.max_tokens
        if role != "compute" or not budget or self.config.sync.synchronous:
            self.ledger.heartbeat(request.worker_id, stats)
            return None
        with self._budget_lock:  # two learners' heartbeats must not hand out the same tokens
            live = self.ledger.live_worker_stats("compute", self.config.coordinator.lease_ttl_s)
            now = self.ledger.clock()
            others = [
                lifecycle.Claim(
                    int(s.get("tokens_unmerged", 0)),
                    int(s.get("tokens_allowed", 0)),
                    training_rate(s),
                    age_s=now - float(s.get("allowed_at", now)),
                    # (below 0 after a coordinator restart: the claim then counts in full)
                    merged_since=max(0, self.ledger.tokens_merged_of(worker_id) - int(s.get("merged_at", 0))),
                )
                for worker_id, s in live.items()
                if worker_id != request.worker_id
            ]
            merged = int(self.ledger.counter("tokens_merged"))
            allowed = lifecycle.training_allowance(
                budget=budget,
                tokens_merged=merged,
                mine=request.tokens_unmerged,
                others=others,
                my_rate=training_rate(stats),
                horizon_s=ALLOWANCE_HORIZON_HEARTBEATS * self.config.coordinator.heartbeat_s,
            )
            # DILOCO_LOG_LEVEL=DEBUG: every allowance with what it was made of (the end game's trace).
            if log.isEnabledFor(logging.DEBUG):  # not on every heartbeat's path otherwise
                log.debug(
                    "allowance worker=%s merged=%d mine=%d others=%s -> %d", request.worker_id, merged,
                    request.tokens_unmerged, [(c.pending, c.untrained(math.inf), round(c.rate)) for c in others],
                    allowed,
                )  # fmt: skip
            stats.update(
                tokens_unmerged=request.tokens_unmerged,
                tokens_allowed=allowed,
                allowed_at=now,
                merged_at=self.ledger.tokens_merged_of(request.worker_id),
            )
            self.ledger.heartbeat(request.worker_id, stats)
        return allowed

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        role = self._role_of(request.worker_id)
        self.wire.unary_in("leave", request, role)
        if self.ledger.known_worker(request.worker_id):  # an unknown id is no one's: nothing to free
            self._require_owner(request.worker_id, context, "Leave")
        self._gone(request.worker_id, "left")
        request.reason = limits.cut_text(request.reason, 512)
        log.info("leave worker=%s reason=%s", request.worker_id, request.reason or "-")
        self.events.record("leave", worker_id=request.worker_id, role=role, reason=request.reason)
        reply = pb.LeaveReply()
        self.wire.add_out("leave", reply, role)
        return reply

    def caller_revoked(self, role: str, name: str) -> None:
        """A certificate in the --tls-crl called (the guard refused it): its worker, the
        certificate's name, is lost at once, not a lease TTL later; its leases go back to the pool
        and no round waits for it (a synchronous round waits for every live learner)."""
        binding = self.ledger.binding(name, self.config.coordinator.lease_ttl_s)
        if binding is None or binding[1] != cert_caller(role, name) or not binding[2]:
            return  # not its worker, or gone already (the reaper takes one whose lease lapsed)
        self._gone(name, "lost")
        log.warning("worker %s (%s) lost: its certificate is revoked", name, binding[0])
        self.events.record("lost", worker_id=name, role=binding[0], reason="certificate revoked")

    def _gone(self, worker_id: str, state: str) -> None:
        """The worker left or is lost: its leases back in the pool, its allowances forgotten."""
        self.ledger.leave(worker_id, state)
        self._heartbeats.forget(worker_id)
        self._allowed.pop(worker_id, None)
        with self.cond:
            self.cond.notify_all()  # one learner fewer: the merger may close a round now
