"""The global parameters: their initialization by the first learner, and the long-poll pull."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import grpc
import torch

from diloco.coordinator import checkpoint
from diloco.coordinator.callers import caller_of
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    MAX_PULL_WAIT_S,
    log,
    stream_header,
)
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import WireError, receive_one, spec_of, stream_many


class ParameterRPCs(ServiceBase):
    def InitParameters(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.InitParametersReply:
        self.wire.call("init")  # its messages are counted as gRPC reads them (CountRequestStreams)
        first, messages = stream_header(
            request_iterator, context, "bad init stream: it must start with a header"
        )
        # Checked at the header, before the call may hold the one initialization slot (and
        # stream a whole model in): only a joined learner's own call may decide the model.
        self._require_worker(first.header.worker_id, context, "InitParameters")
        with self.cond:
            # Learners that join together all offer their parameters; one is taken. The others
            # are answered at the header, before their megabytes are sent, and pull instead.
            busy = "already initialized" if self.fragments else self._initializing
            if not busy:
                self._initializing = f"being initialized by {first.header.worker_id or '?'}"
        if busy:
            reply = pb.InitParametersReply(accepted=False, reason=f"{busy}; pull the parameters")
            self.wire.add_out("init", reply)
            return reply
        try:
            return self._init_parameters(first, messages, context)
        finally:
            with self.cond:
                self._initializing = None
                self.cond.notify_all()

    def _init_parameters(
        self,
        first: pb.TensorStreamMessage,
        messages: Iterator[pb.TensorStreamMessage],
        context: grpc.ServicerContext,
    ) -> pb.InitParametersReply:
        try:
            header, tensors = receive_one(
                itertools.chain([first], messages), self.config.coordinator.max_push_bytes
            )
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad init stream: {e}")
        bad = [n for n, t in tensors.items() if not t.is_floating_point() or not torch.isfinite(t).all()]
        if bad or not tensors:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"init parameters must be finite floats (bad: {bad[:3]})"
            )
        with self.cond:
            if self.fragments:
                reply = pb.InitParametersReply(
                    accepted=False, reason="already initialized; pull the parameters"
                )
            else:
                averaged = {s.name for s in header.tensors if s.averaged}  # running statistics
                specs = [spec_of(n, t) for n, t in tensors.items()]
                for spec in specs:
                    spec.averaged = spec.name in averaged
                self._install_specs(specs)  # before the fragments' round sums, which take `averaged`
                plan = self._fragment_names(specs)
                states = []
                for p, names in enumerate(plan):
                    params = {n: tensors[n].clone() for n in names}
                    momentum = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in params.items()}
                    checkpoint.save_fragment(self.checkpoint_root, p, 0, params, momentum)
                    states.append(self._fragment_state(p, names, params, momentum, 0))
                # The specs are the "initialized" marker: written only once every file exists.
                self.ledger.set_meta(
                    param_specs=json.dumps(
                        [
                            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "averaged": s.averaged}
                            for s in specs
                        ]
                    ),
                    **{f"fragment_version.{p}": "0" for p in range(len(plan))},
                )
                self.fragments = states
                log.info(
                    "initialized %d tensors in %d fragment(s) from worker=%s",
                    len(specs),
                    len(plan),
                    header.worker_id,
                )
                self.cond.notify_all()
                reply = pb.InitParametersReply(accepted=True, reason="initialized")
        self.wire.add_out("init", reply)
        return reply

    def PullParameters(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TensorStreamMessage]:
        # A learner that holds nothing yet pays a one-time join cost: counted apart, so the
        # steady-state bytes per token can be told from it.
        held = list(request.have_versions)
        kind = "pull" if held and all(v >= 0 for v in held) else "pull_join"
        if self._role_of(request.worker_id) == "evaluator":
            kind = "eval_pull"  # monitoring: kept out of the learners' bytes per token
        self.wire.unary_in(kind, request)
        self._require_worker(request.worker_id, context, "PullParameters")
        if list(request.have_versions) and len(request.have_versions) != len(request.fragments):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "have_versions must match fragments")
        wait_s = min(max(request.wait_s, 0.0), MAX_PULL_WAIT_S)
        if wait_s <= 0:
            yield from self._pull(request, context, kind, wait_s)
            return
        # A long-poll holds a handler thread while it waits: bounded per caller and in all, below
        # the thread pool, so joins, heartbeats and leases always find one.
        c, caller = self.config.coordinator, caller_of(context)
        if problem := self.callers.open("pull", caller, c.max_waiting_pulls_per_caller, c.max_waiting_pulls):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{problem}; retry shortly")
        try:
            yield from self._pull(request, context, kind, wait_s)
        finally:
            self.callers.close("pull", caller)

    def _pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext, kind: str, wait_s: float
    ) -> Iterator[pb.TensorStreamMessage]:
        deadline = time.monotonic() + wait_s
        with self.cond:
            while not self.fragments and time.monotonic() < deadline and not self._stop.is_set():
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if not self.fragments:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "no parameters yet: a learner must initialize them"
                )
            wanted = list(request.fragments) or list(range(len(self.fragments)))
            if any(p >= len(self.fragments) for p in wanted):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment in {wanted}")
            have = dict(zip(wanted, request.have_versions, strict=False))
            above = dict(zip(wanted, request.wait_above, strict=False)) if request.wait_above else have

            def newer() -> list[int]:
                return [p for p in wanted if p not in above or self.fragments[p].published_version > above[p]]

            while (
                not newer()
                and time.monotonic() < deadline
                and not self._stop.is_set()
                and context.is_active()
            ):
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            # Tensors are replaced, never changed in place, so this snapshot stays consistent.
            groups = [g for p in newer() for g in self._pull_groups(p, have.get(p, -1))]
        piece = self.config.coordinator.stream_chunk_bytes
        started, role = time.monotonic(), "evaluator" if kind == "eval_pull" else "compute"
        yield from self.wire.count_out(kind, stream_many(groups, piece))
        self.metrics.pull_seconds.labels(role=role).observe(time.monotonic() - started)
        self.metrics.pull_bytes.labels(role=role).observe(
            sum(t.numel() * t.element_size() for _, tensors in groups for t in tensors.values())
        )
