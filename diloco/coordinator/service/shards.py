"""The learners' shard RPCs: a dealt lease of rows to train on; a corrupt shard reported."""

from __future__ import annotations

import grpc

from diloco.coordinator import deal, limits
from diloco.coordinator.lease_claims import Refusal
from diloco.coordinator.ledger import NoLease, ShardLease
from diloco.coordinator.log_text import loggable
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    log,
)
from diloco.v1 import coordinator_pb2 as pb

DEALT_RETRY_S = 0.1


class ShardRPCs(ServiceBase):
    def LeaseShard(self, request: pb.LeaseShardRequest, context: grpc.ServicerContext) -> pb.LeaseShardReply:
        self.wire.unary_in("lease_shard", request)
        self._require_worker(request.worker_id, context, "LeaseShard")
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
        elif self._holds_enough(request.worker_id):
            reply = pb.LeaseShardReply(retry_after_s=1.0, run_state=self._state_pb())
        else:
            slots = self.config.data.deal
            live = set(self._live_learners()) if slots else set()
            with self.cond:  # the slot map is shared by every LeaseShard handler
                slot = deal.take_slot(slots, self._deal_slots, live, request.worker_id) if slots else None
                if slot is not None:
                    self._deal_slots = {
                        w: s for w, s in self._deal_slots.items() if s != slot or w == request.worker_id
                    }
                    self._deal_slots[request.worker_id] = slot
                vacant = deal.vacant_slots(slots, self._deal_slots, live) if slots else set()
            lease = self.ledger.lease_shard(request.worker_id, ttl, slot, slots, vacant)
            if isinstance(lease, ShardLease):
                log.info(
                    "shard %d (train position %d) leased to %s: %s",
                    lease.shard_id,
                    lease.position,
                    request.worker_id,
                    lease.reason,
                )
                reply = pb.LeaseShardReply(
                    shard_id=lease.shard_id,
                    uri=lease.uri,
                    checksum=lease.checksum,
                    rows=lease.rows,
                    todo=[
                        pb.ShardSpan(shard_id=lease.shard_id, row_start=a, row_end=b) for a, b in lease.todo
                    ],
                    lease_ttl_s=ttl,
                    run_state=self._state_pb(),
                    deal_slot=0 if lease.slot is None else lease.slot + 1,
                )
            elif lease in (NoLease.WAIT, NoLease.WAIT_DEALT):
                reply = pb.LeaseShardReply(
                    # The learner's own next shard is being made (a chunk of small samples takes
                    # ~0.05 s): asked for again soon; nothing coming: twice a second.
                    retry_after_s=DEALT_RETRY_S if lease is NoLease.WAIT_DEALT else 0.5,
                    run_state=self._state_pb(),
                    dealt_shard_coming=lease is NoLease.WAIT_DEALT,
                )
            else:
                reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
        self.wire.add_out("lease_shard", reply)
        return reply

    def ReportShard(
        self, request: pb.ReportShardRequest, context: grpc.ServicerContext
    ) -> pb.ReportShardReply:
        """A learner's shard that failed its checksum: taken from the learner that leased it last
        (lease_claims.report_verdict). A report of a lease that has since gone to another learner
        is answered "not reprocessing" (an honest learner whose lease lapsed sends it); one of a
        shard the caller never leased, or one report too many, is refused."""
        self.wire.unary_in("report_shard", request)
        self._require_worker(request.worker_id, context, "ReportShard")
        error = limits.cut_text(request.error)
        verdict = self.ledger.report_shard(request.worker_id, request.shard_id, error)
        if verdict.refusal is not None:
            self.ledger.bump("shard_reports_refused")
            if verdict.refusal is not Refusal.STALE:
                self.caller_refused("ReportShard", verdict.reason, context.peer())
                code = _REFUSAL_CODES[verdict.refusal]
                context.abort(code, verdict.reason)
            log.info(
                "shard %d report by %s not taken: %s", request.shard_id, request.worker_id, verdict.reason
            )
        else:
            log.warning(
                "shard %d reported corrupt by %s (%s); reprocessing",
                request.shard_id,
                request.worker_id,
                loggable(error),
            )
        reply = pb.ReportShardReply(reprocessing=verdict.taken)
        self.wire.add_out("report_shard", reply)
        return reply


_REFUSAL_CODES = {
    Refusal.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.TOO_MANY: grpc.StatusCode.FAILED_PRECONDITION,
}
