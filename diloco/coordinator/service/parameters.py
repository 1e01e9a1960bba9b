"""The global parameters: their initialization by the first learner, and the long-poll pull.

An init is checked at its header (init_check: its tensors, running statistics by name, the run's
fragments and model) before it may take the one initialization slot; its stream is watched like a
push's (stream_watch), so a stalled one is cut and frees the slot; once the run has parameters an
init is answered at once, its stream unread."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
import torch

from diloco.coordinator import checkpoint, limits
from diloco.coordinator.callers import caller_of
from diloco.coordinator.init_check import header_problem, model_problem
from diloco.coordinator.log_text import loggable
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    MAX_PULL_WAIT_S,
    log,
    stream_header,
)
from diloco.coordinator.stream_watch import StreamLimits, StreamWatch
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import WireError, nbytes_of, receive_one, stream_many

# An init stream's header comes first and at once: a stream that sends none within this is cut.
INIT_HEADER_WAIT_S = 10.0
# How long an init waits for the run's model to be built to check it against (init_check.RunModel:
# started with the service, built long before the first learner joins); past it, unchecked.
RUN_MODEL_WAIT_S = 60.0


class ParameterRPCs(ServiceBase):
    # The init stream's deadlines run on this clock (tests move it).
    stream_clock: Callable[[], float] = staticmethod(time.monotonic)

    def InitParameters(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.InitParametersReply:
        self.wire.call("init")  # its messages are counted as gRPC reads them (CountRequestStreams)
        if self.fragments:  # answered at once, the stream left unread: it holds no thread
            return self._init_reply("already initialized; pull the parameters")
        # Streams held open before the init, by one caller and by all: bounded like pushes, so
        # silent streams cannot take every handler thread (70 of them once stopped the run).
        c, caller = self.config.coordinator, caller_of(context)
        if problem := self.callers.open("init", caller, c.max_pushes_per_caller, c.max_inflight_pushes):
            self._refuse_init(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many init streams", problem)
        limits_ = StreamLimits(c.push_idle_s, c.push_base_s, c.push_min_bytes_per_s, INIT_HEADER_WAIT_S)

        def cancel(reason: str) -> None:
            log.warning("init stream stalled, cancelled: %s", reason)
            self.ledger.bump("inits_refused")
            self.metrics.refused("stalled stream")
            context.cancel()  # the handler's next read raises: the init slot is freed below

        try:
            with StreamWatch(limits_, cancel, clock=self.stream_clock) as watch:
                return self._init_stream(watch.messages(request_iterator), context, watch)
        finally:
            self.callers.close("init", caller)

    def _init_stream(
        self, messages: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext, watch: StreamWatch
    ) -> pb.InitParametersReply:
        first, messages = stream_header(messages, context, "bad init stream: it must start with a header")
        header = first.header
        # Checked at the header, before the call may hold the one initialization slot (and
        # stream a whole model in): only a joined learner's own call may decide the model...
        self._require_worker(header.worker_id, context, "InitParameters")
        if self.fragments:
            return self._init_reply("already initialized; pull the parameters")
        # ...and only a model the run can take, refused before anything changes.
        plan, problem = header_problem(
            header.tensors, self.config.coordinator.max_push_bytes, self.config.sync.fragments
        )
        unchecked = ""
        if not problem:
            problem, unchecked = model_problem(header.tensors, *self.run_model.get(RUN_MODEL_WAIT_S))
            watch.last = self.stream_clock()  # a wait for the model is ours, not the stream's silence
        if problem:
            self._refuse_init(context, grpc.StatusCode.INVALID_ARGUMENT, "bad init", problem)
        watch.declared_bytes = sum(nbytes_of(s) for s in header.tensors)
        with self.cond:
            # Learners that join together all offer their parameters; one is taken. The others
            # are answered at the header, before their megabytes are sent, and pull instead.
            busy = "already initialized" if self.fragments else self._initializing
            if not busy:
                self._initializing = f"being initialized by {header.worker_id}"
        if busy:
            return self._init_reply(f"{busy}; pull the parameters")
        try:
            return self._init_parameters(first, messages, plan, unchecked, context)
        finally:  # also when the watch cut the stream: another learner may initialize
            with self.cond:
                self._initializing = None
                self.cond.notify_all()

    def _init_parameters(
        self,
        first: pb.TensorStreamMessage,
        messages: Iterator[pb.TensorStreamMessage],
        plan: list[list[str]],
        unchecked: str,
        context: grpc.ServicerContext,
    ) -> pb.InitParametersReply:
        try:
            header, tensors = receive_one(
                itertools.chain([first], messages), self.config.coordinator.max_push_bytes
            )
        except WireError as e:
            self._refuse_init(context, grpc.StatusCode.INVALID_ARGUMENT, "bad init stream", str(e))
        bad = [n for n, t in tensors.items() if not torch.isfinite(t).all()]
        if bad:
            self._refuse_init(context, grpc.StatusCode.INVALID_ARGUMENT, "bad init", f"not finite: {bad[:3]}")
        specs = list(header.tensors)  # checked at the header (init_check), `averaged` marks too
        with self.cond:
            if self.fragments:
                return self._init_reply("already initialized; pull the parameters")
            # Every file is written before any state changes: a failure leaves the run as it was.
            fragments = []
            for p, names in enumerate(plan):
                params = {n: tensors[n].clone() for n in names}
                momentum = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in params.items()}
                checkpoint.save_fragment(self.checkpoint_root, p, 0, params, momentum)
                fragments.append((names, params, momentum))
            self._install_specs(specs)  # before the fragments' round sums, which take `averaged`
            states = [self._fragment_state(p, *fragment, 0) for p, fragment in enumerate(fragments)]
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
            if unchecked:  # once: a run is initialized once
                log.warning("the init was not checked against the run's model: %s", unchecked)
            self.cond.notify_all()
        return self._init_reply("initialized", accepted=True)

    def _init_reply(self, reason: str, accepted: bool = False) -> pb.InitParametersReply:
        reply = pb.InitParametersReply(accepted=accepted, reason=reason)
        self.wire.add_out("init", reply)
        return reply

    def _refuse_init(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, kind: str, why: str
    ) -> NoReturn:
        """Refuse an init with `kind: why`: counted (the ledger's inits_refused, the refusals'
        metric by kind) and logged, a kind at most once a minute. Nothing has changed."""
        reason = f"{kind}: {limits.cut_text(why, 1024)}"
        self.ledger.bump("inits_refused")
        self.metrics.refused(kind)
        say, quiet = self._refusal_log.note(f"InitParameters: {kind}", time.monotonic())
        if say:
            more = f" ({quiet} more like it before)" if quiet else ""
            log.warning("init refused from %s: %s%s", caller_of(context), loggable(reason), more)
        context.abort(code, reason)
        raise AssertionError("unreachable")  # abort raises

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
