"""ReportEval: an evaluator's held-out loss of a published global model, kept for status."""

from __future__ import annotations

import math

import grpc

from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import log
from diloco.v1 import coordinator_pb2 as pb

# Status carries the latest evaluations (a curve's worth); the ledger keeps them all.
STATUS_EVALS = 200
MAX_EVAL_METRICS = 32


def eval_report_problem(request: pb.ReportEvalRequest, fragments: int) -> str:
    """Why a report cannot be recorded ("" when it can): it must name one version per fragment
    and carry finite numbers, a few of them."""
    if len(request.fragment_versions) != fragments:
        return f"{len(request.fragment_versions)} fragment versions for {fragments} fragments"
    if not math.isfinite(request.loss) or not math.isfinite(request.seconds):
        return "loss and seconds must be finite"
    if len(request.metrics) > MAX_EVAL_METRICS:
        return f"more than {MAX_EVAL_METRICS} metrics"
    bad = sorted(name for name, value in request.metrics.items() if not math.isfinite(value))
    if bad:
        return f"metrics not finite: {', '.join(bad)}"
    return ""


class EvalRPCs(ServiceBase):
    def ReportEval(self, request: pb.ReportEvalRequest, context: grpc.ServicerContext) -> pb.ReportEvalReply:
        self.wire.unary_in("report_eval", request)
        self._require_worker(request.worker_id, context, "ReportEval")
        problem = eval_report_problem(request, self.config.sync.fragments)
        if not problem:
            self.ledger.record_eval(
                request.worker_id,
                list(request.fragment_versions),
                request.tokens_merged,
                request.loss,
                dict(request.metrics),
                request.rows,
                request.seconds,
            )
            self.events.record(
                "eval", worker_id=request.worker_id, fragment_versions=list(request.fragment_versions),
                tokens_merged=request.tokens_merged, loss=request.loss, metrics=dict(request.metrics),
                rows=request.rows,
            )  # fmt: skip
            log.info(
                "eval worker=%s versions=%s loss=%.4f rows=%d",
                request.worker_id,
                list(request.fragment_versions),
                request.loss,
                request.rows,
            )
        reply = pb.ReportEvalReply(accepted=not problem, reason=problem, run_state=self._state_pb())
        self.wire.add_out("report_eval", reply)
        return reply
