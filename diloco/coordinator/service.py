"""The coordinator's gRPC service: membership, leases, the syncer, checkpoints, status.

State that must survive a crash lives in the ledger (committed before an RPC answers) and in the
checkpoint files; what lives only here is the open round of each fragment (its pushes' tensors),
which a crash drops — the ledger then marks those pushes dropped, and their rows go back to the
pool. Decisions (quorum, grace window, merge, outer step, lease expiry) are the pure functions of
syncer.py and leases.py; this module only applies them under one lock.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator import checkpoint, syncer
from diloco.coordinator.ledger import ChunkLease, Ledger, ShardLease
from diloco.coordinator.wirecount import WireCounter
from diloco.fragments import assign_fragments
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pb_grpc
from diloco.wire import codecs
from diloco.wire.codecs import CodecError
from diloco.wire.tensors import TensorAssembler, WireError, receive_one, spec_of, stream_many

log = logging.getLogger("diloco.coordinator")

ROLE_NAMES = {pb.ROLE_DATA: "data", pb.ROLE_COMPUTE: "compute", pb.ROLE_OBSERVER: "observer"}
RUN_STATES = {
    "running": pb.RUN_STATE_RUNNING,
    "finishing": pb.RUN_STATE_FINISHING,
    "finished": pb.RUN_STATE_FINISHED,
}
MAX_PULL_WAIT_S = 30.0
PUSH_SLOT_WAIT_S = 10.0


@dataclass
class PendingPush:
    arrival: syncer.Arrival
    push_id: str
    tensors: dict[str, torch.Tensor]
    mean_loss: float
    first_loss: float


@dataclass
class FragmentState:
    names: list[str]
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    version: int
    round: syncer.RoundState
    pending: list[PendingPush] = field(default_factory=list)
    # What up-to-date learners hold: Θ itself with fp32 pulls; with a pull codec, the sum of the
    # encoded deltas sent so far. Θ − broadcast is the coordinator's error feedback: it goes out
    # with the next delta, so the learners' copy never drifts from Θ.
    broadcast: dict[str, torch.Tensor] = field(default_factory=dict)
    # version -> the encoded blobs of broadcast(version) − broadcast(version − 1), the last few.
    chain: dict[int, dict[str, bytes]] = field(default_factory=dict)


def policy_of(config: RunConfig) -> syncer.SyncPolicy:
    s = config.sync
    return syncer.SyncPolicy(
        quorum=s.quorum,
        merge=s.merge,
        outer_lr=s.outer_lr,
        outer_momentum=s.outer_momentum,
        nesterov=s.nesterov,
        max_staleness=s.max_staleness,
        grace_factor=s.grace_factor,
        overlap_steps=s.overlap_steps,
    )


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        config: RunConfig,
        ledger: Ledger,
        checkpoint_root: str,
        shard_root: str,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.ledger = ledger
        self.checkpoint_root = checkpoint_root
        self.shard_root = shard_root
        self.clock = clock
        self.policy = policy_of(config)
        self.cond = threading.Condition(threading.RLock())
        self.wire = WireCounter()
        self._push_slots = threading.BoundedSemaphore(config.coordinator.max_inflight_pushes)
        self.epoch = ledger.next_epoch()
        self.run_state = ledger.get_meta("run_state", "running") or "running"
        self.started_at = clock()
        self.fragments: list[FragmentState] = []
        self.specs: dict[str, pb.TensorSpec] = {}
        self.step_time_s = 0.0  # EMA of learners' reported inner step time
        self.sync_time_s = 0.0  # EMA of merge duration
        self.last_loss = math.nan
        self._load_parameters()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_forever, name="syncer-tick", daemon=True)

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._ticker.start()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)

    def _load_parameters(self) -> None:
        """After a restart: the global fragments at the versions the ledger last committed."""
        raw = self.ledger.get_meta("param_specs")
        if raw is None:
            return
        specs = [pb.TensorSpec(name=s["name"], dtype=s["dtype"], shape=s["shape"]) for s in json.loads(raw)]
        self._install_specs(specs)
        for p, names in enumerate(self._fragment_names(specs)):
            version = self.ledger.fragment_version(p)
            params, momentum = checkpoint.load_fragment(self.checkpoint_root, p, version)
            self.fragments.append(self._fragment_state(p, names, params, momentum, version))
        log.info("resumed fragments at versions %s", [f.version for f in self.fragments])

    def _install_specs(self, specs: list[pb.TensorSpec]) -> None:
        self.specs = {s.name: s for s in specs}

    def _fragment_names(self, specs: list[pb.TensorSpec]) -> list[list[str]]:
        sizes = [(s.name, math.prod(s.shape)) for s in specs]
        return assign_fragments(sizes, self.config.sync.fragments)

    def _fragment_state(
        self,
        p: int,
        names: list[str],
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor],
        version: int,
    ) -> FragmentState:
        round_ = syncer.RoundState(p, version, self.clock())
        return FragmentState(names, params, momentum, version, round_, broadcast=params)

    # -- helpers --------------------------------------------------------------------------------

    def _state_pb(self) -> int:
        return RUN_STATES[self.run_state]

    def _require_worker(self, worker_id: str, context: grpc.ServicerContext) -> None:
        if not worker_id or not self.ledger.known_worker(worker_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {worker_id!r}: join first")

    def _live_learners(self) -> list[str]:
        return self.ledger.live_workers("compute", self.config.coordinator.lease_ttl_s)

    def _set_run_state(self, state: str, reason: str) -> None:
        with self.cond:
            if self.run_state == state or (self.run_state == "finished" and state != "finished"):
                return
            self.run_state = state
            self.ledger.set_meta(run_state=state)
            log.info("run %s (%s)", state, reason)
            self.cond.notify_all()

    # -- membership -----------------------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self.wire.add_in("join", request)
        role = ROLE_NAMES.get(request.role)
        if role is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "join needs a role")
        worker_id = request.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.ledger.join(worker_id, role, request.host or "?")
        log.info("join worker=%s role=%s host=%s", worker_id, role, request.host)
        reply = pb.JoinReply(
            worker_id=worker_id,
            config_json=self.config.to_json(),
            coordinator_epoch=self.epoch,
            needs_init=not self.fragments,
            num_fragments=self.config.sync.fragments,
            run_state=self._state_pb(),
            heartbeat_s=self.config.coordinator.heartbeat_s,
        )
        with self.cond:
            self.cond.notify_all()
        self.wire.add_out("join", reply)
        return reply

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        self.wire.add_in("heartbeat", request)
        self._require_worker(request.worker_id, context)
        stats = {
            "inner_steps": request.inner_steps,
            "tokens_trained": request.tokens_trained,
            "last_loss": request.last_loss,
            "busy_seconds": request.busy_seconds,
            "wall_seconds": request.wall_seconds,
            "data_stall_seconds": request.data_stall_seconds,
            "sync_wait_seconds": request.sync_wait_seconds,
        }
        ttl = self.config.coordinator.lease_ttl_s
        self.ledger.heartbeat(request.worker_id, stats)
        lost_chunks, lost_shards = self.ledger.renew(
            request.worker_id, request.chunk_leases, request.shard_leases, ttl
        )
        reply = pb.HeartbeatReply(
            run_state=self._state_pb(),
            coordinator_epoch=self.epoch,
            lost_chunk_leases=lost_chunks,
            lost_shard_leases=lost_shards,
        )
        self.wire.add_out("heartbeat", reply)
        return reply

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.wire.add_in("leave", request)
        self.ledger.leave(request.worker_id)
        log.info("leave worker=%s reason=%s", request.worker_id, request.reason or "-")
        with self.cond:
            self._close_ready_rounds()
        return pb.LeaveReply()

    # -- data workers ---------------------------------------------------------------------------

    def LeaseChunk(self, request: pb.LeaseChunkRequest, context: grpc.ServicerContext) -> pb.LeaseChunkReply:
        self.wire.add_in("lease_chunk", request)
        self._require_worker(request.worker_id, context)
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseChunkReply(done=True, run_state=self._state_pb())
        else:
            lease = self.ledger.lease_chunk(
                request.worker_id, ttl, self.config.coordinator.max_chunk_attempts
            )
            if isinstance(lease, ChunkLease):
                shard_uri = store.join(self.shard_root, f"chunk-{lease.chunk_id:06d}-a{lease.attempt}.shard")
                reply = pb.LeaseChunkReply(
                    chunk_id=lease.chunk_id,
                    split=lease.spec.split,
                    shard_uri=shard_uri,
                    lease_ttl_s=ttl,
                    segments=[
                        pb.Segment(uri=s.uri, start=s.start, end=s.end, file_end=s.file_end)
                        for s in lease.spec.segments
                    ],
                    run_state=self._state_pb(),
                )
            elif lease == "wait":
                reply = pb.LeaseChunkReply(retry_after_s=1.0, run_state=self._state_pb())
            else:
                reply = pb.LeaseChunkReply(done=True, run_state=self._state_pb())
        self.wire.add_out("lease_chunk", reply)
        return reply

    def CompleteChunk(
        self, request: pb.CompleteChunkRequest, context: grpc.ServicerContext
    ) -> pb.CompleteChunkReply:
        self.wire.add_in("complete_chunk", request)
        self._require_worker(request.worker_id, context)
        if not request.completion_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "completion_id is required")
        if not request.shard_uri.startswith(self.shard_root.rstrip("/") + "/"):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"shard {request.shard_uri!r} is outside the shard store"
            )
        if request.rows and request.tokens % request.rows:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be a whole number of rows")
        done = self.ledger.complete_chunk(
            request.worker_id,
            request.chunk_id,
            request.completion_id,
            request.shard_uri,
            request.rows,
            request.tokens,
            request.checksum,
            request.shard_bytes,
            dict(request.record_stats),
        )
        log.info(
            "chunk %d complete worker=%s accepted=%s (%s) rows=%d",
            request.chunk_id,
            request.worker_id,
            done.accepted,
            done.reason,
            request.rows,
        )
        reply = pb.CompleteChunkReply(accepted=done.accepted, reason=done.reason, shard_id=done.shard_id)
        self.wire.add_out("complete_chunk", reply)
        return reply

    def FailChunk(self, request: pb.FailChunkRequest, context: grpc.ServicerContext) -> pb.FailChunkReply:
        self.wire.add_in("fail_chunk", request)
        self._require_worker(request.worker_id, context)
        quarantined = self.ledger.fail_chunk(
            request.worker_id, request.chunk_id, request.error, self.config.coordinator.max_chunk_attempts
        )
        log.warning(
            "chunk %d failed worker=%s quarantined=%s: %s",
            request.chunk_id,
            request.worker_id,
            quarantined,
            request.error.splitlines()[0] if request.error else "",
        )
        reply = pb.FailChunkReply(quarantined=quarantined)
        self.wire.add_out("fail_chunk", reply)
        return reply

    # -- learners: shards -----------------------------------------------------------------------

    def LeaseShard(self, request: pb.LeaseShardRequest, context: grpc.ServicerContext) -> pb.LeaseShardReply:
        self.wire.add_in("lease_shard", request)
        self._require_worker(request.worker_id, context)
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
        else:
            lease = self.ledger.lease_shard(request.worker_id, ttl)
            if isinstance(lease, ShardLease):
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
                )
            elif lease == "wait":
                reply = pb.LeaseShardReply(retry_after_s=0.5, run_state=self._state_pb())
            else:
                reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
        self.wire.add_out("lease_shard", reply)
        return reply

    def ReportShard(
        self, request: pb.ReportShardRequest, context: grpc.ServicerContext
    ) -> pb.ReportShardReply:
        self.wire.add_in("report_shard", request)
        self._require_worker(request.worker_id, context)
        again = self.ledger.report_corrupt_shard(request.shard_id, request.error)
        log.warning(
            "shard %d reported corrupt by %s (%s); reprocessing=%s",
            request.shard_id,
            request.worker_id,
            request.error,
            again,
        )
        reply = pb.ReportShardReply(reprocessing=again)
        self.wire.add_out("report_shard", reply)
        return reply

    # -- learners: parameters -------------------------------------------------------------------

    def InitParameters(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.InitParametersReply:
        try:
            header, tensors = receive_one(
                self.wire.count_in("init", request_iterator), self.config.coordinator.max_push_bytes
            )
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad init stream: {e}")
        self._require_worker(header.worker_id, context)
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
                specs = [spec_of(n, t) for n, t in tensors.items()]
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
                        [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs]
                    ),
                    **{f"fragment_version.{p}": "0" for p in range(len(plan))},
                )
                self._install_specs(specs)
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
        self.wire.add_in("pull", request)
        if list(request.have_versions) and len(request.have_versions) != len(request.fragments):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "have_versions must match fragments")
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), MAX_PULL_WAIT_S)
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
                return [p for p in wanted if p not in above or self.fragments[p].version > above[p]]

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
        yield from self.wire.count_out("pull", stream_many(groups, piece))

    def PushDelta(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.PushReply:
        # At most max_inflight_pushes deltas are held at once; the rest are told to come back
        # (clients retry RESOURCE_EXHAUSTED with backoff), so memory does not grow with learners.
        if not self._push_slots.acquire(timeout=PUSH_SLOT_WAIT_S):
            self.ledger.bump("pushes_deferred")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many pushes in flight; retry shortly")
        try:
            return self._push_delta(request_iterator, context)
        finally:
            self._push_slots.release()

    def _push_delta(
        self, request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext
    ) -> pb.PushReply:
        messages = self.wire.count_in("push", request_iterator)
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push stream must start with a header")
        header = first.header
        self._require_worker(header.worker_id, context)
        if not header.push_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push_id is required")
        if not self.fragments:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no parameters yet")
        if header.fragment >= len(self.fragments):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment {header.fragment}")

        prior = self.ledger.push_state(header.push_id)
        if prior is not None:  # a retry after a lost reply: answer again, change nothing
            for _ in messages:
                pass
            # A merged push answers with the version just before its merge, so the learner's
            # "newer than" pull returns the merge that holds it at once.
            merged_at = prior["merged_version"]
            reply = pb.PushReply(
                accepted=prior["state"] != "dropped",
                reason=prior["reason"] or f"already received ({prior['state']})",
                version=merged_at - 1 if merged_at else self.fragments[header.fragment].version,
            )
            self.wire.add_out("push", reply)
            return reply

        frag = self.fragments[header.fragment]
        empty = header.tokens == 0 and not header.tensors
        tensors: dict[str, torch.Tensor] = {}
        codec = header.codec or "fp32"
        if codec != self.config.sync.codec:
            self.ledger.bump("pushes_malformed")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"push uses codec {codec!r} but this run is configured for {self.config.sync.codec!r}",
            )
        if not empty:
            try:
                tensors = self._receive_delta(header, frag.names, codec, messages)
            except (WireError, CodecError) as e:
                self.ledger.bump("pushes_malformed")
                log.warning("push refused worker=%s: %s", header.worker_id, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {e}")
            bad = [n for n, t in tensors.items() if not torch.isfinite(t).all()]
            if bad:
                self.ledger.bump("pushes_malformed")
                log.warning("push refused worker=%s: non-finite values in %s", header.worker_id, bad[:3])
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"non-finite values in {bad[:3]}")
            if header.tokens == 0 or header.inner_steps == 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a delta must report its steps and tokens")
        else:
            for _ in messages:
                pass

        with self.cond:
            reply = self._accept_push(header, tensors, empty)
            self._close_ready_rounds()
        self.wire.add_out("push", reply)
        return reply

    def _receive_delta(
        self,
        header: pb.TensorHeader,
        names: list[str],
        codec: str,
        messages: Iterator[pb.TensorStreamMessage],
    ) -> dict[str, torch.Tensor]:
        """The delta's fp32 tensors: raw for fp32, else one encoded blob per tensor, decoded here."""
        if codec == "fp32":
            expected = {n: self.specs[n] for n in names}
        else:
            expected = None
            blobs = {s.name: s for s in header.tensors}
            if set(blobs) != set(names) or any(
                s.dtype != "uint8" or len(s.shape) != 1 for s in blobs.values()
            ):
                raise WireError(f"a {codec} push carries one 1-D uint8 blob per tensor of the fragment")
        asm = TensorAssembler(header, self.config.coordinator.max_push_bytes, expected)
        for msg in messages:
            if msg.WhichOneof("kind") != "piece":
                raise WireError("only one header is allowed in a push")
            asm.add(msg.piece)
        received = asm.tensors()
        if codec == "fp32":
            return received
        return {
            n: codecs.decode(received[n].numpy().tobytes(), codec, tuple(self.specs[n].shape)) for n in names
        }

    def _accept_push(
        self, header: pb.TensorHeader, tensors: dict[str, torch.Tensor], empty: bool
    ) -> pb.PushReply:
        frag = self.fragments[header.fragment]
        released = list(header.released_shards)
        if empty:
            # "Nothing this round" (a learner waiting for data): counts for closing, merges nothing.
            self.ledger.release_shards(header.worker_id, released)
            frag.round.arrivals[:] = [
                a for a in frag.round.arrivals if not (a.worker_id == header.worker_id and a.tokens == 0)
            ]
            frag.round.arrivals.append(syncer.Arrival(header.worker_id, 0, 0, self.clock(), header.version))
            return pb.PushReply(accepted=True, reason="nothing to merge", version=frag.version)
        spans = [(s.shard_id, s.row_start, s.row_end) for s in header.spans]
        stale = syncer.staleness_refusal(self.policy, header.version, frag.version)
        # A stale push is recorded too (dropped, with its reason): a retry of it gets the same answer.
        refusal = (
            self.ledger.record_push(
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
            )
            or stale
        )
        if refusal is not None:
            log.info("push refused worker=%s fragment=%d: %s", header.worker_id, header.fragment, refusal)
            return pb.PushReply(accepted=False, reason=refusal, version=frag.version)
        arrival = syncer.Arrival(
            header.worker_id,
            header.tokens,
            header.inner_steps,
            self.clock(),
            header.version,
            header.step_time_s,
        )
        frag.round.arrivals.append(arrival)
        frag.pending.append(
            PendingPush(arrival, header.push_id, tensors, header.mean_loss, header.first_loss)
        )
        if header.step_time_s > 0:
            self.step_time_s = (
                header.step_time_s
                if self.step_time_s == 0
                else 0.8 * self.step_time_s + 0.2 * header.step_time_s
            )
        if header.first_loss and self.ledger.get_meta("first_loss") is None:
            self.ledger.set_meta(first_loss=repr(header.first_loss))
        return pb.PushReply(accepted=True, reason="queued for merge", version=frag.version)

    # -- the syncer -----------------------------------------------------------------------------

    def _close_ready_rounds(self) -> None:
        """Merge every fragment whose round the pure decision says is ready (lock held)."""
        if not self.fragments:
            return
        live = self._live_learners()
        now = self.clock()
        for frag in self.fragments:
            decision = syncer.decide_close(
                frag.round, now, self.policy, live, self.step_time_s, self.sync_time_s
            )
            if decision.close:
                self._merge(frag, decision.reason)

    def _merge(self, frag: FragmentState, reason: str) -> None:
        p = frag.round.fragment
        pending = frag.pending
        if not pending:  # only "nothing this round" arrivals: reopen, the version stays
            frag.round = syncer.RoundState(p, frag.version, self.clock())
            return
        started = time.monotonic()
        weights = syncer.merge_weights(
            [q.arrival.tokens for q in pending], [q.arrival.steps for q in pending], self.policy.merge
        )
        contributors = {q.arrival.worker_id for q in pending}
        scale = syncer.coverage_scale(len(contributors), len(contributors | set(self._live_learners())))
        outer_grad = {
            n: g * scale
            for n, g in syncer.merge_deltas([q.tensors for q in pending], weights, self.policy.merge).items()
        }
        params, momentum = syncer.outer_step(
            frag.params,
            frag.momentum,
            outer_grad,
            self.policy.outer_lr,
            self.policy.outer_momentum,
            self.policy.nesterov,
            fraction=scale,
        )
        version = frag.version + 1
        checkpoint.save_fragment(self.checkpoint_root, p, version, params, momentum)
        tokens = sum(q.arrival.tokens for q in pending)
        steps = sum(q.arrival.steps for q in pending)
        losses = [q.mean_loss for q in pending if q.mean_loss > 0]
        mean_loss = sum(losses) / len(losses) if losses else None
        self.ledger.commit_merge(
            p, version, [q.push_id for q in pending], tokens, steps, mean_loss, reason, scale
        )
        checkpoint.prune_fragment(self.checkpoint_root, p, version)
        frag.params, frag.momentum, frag.version = params, momentum, version
        self._extend_broadcast(frag)
        frag.pending = []
        frag.round = syncer.RoundState(p, version, self.clock())
        if mean_loss is not None:
            self.last_loss = mean_loss
        elapsed = time.monotonic() - started
        self.sync_time_s = elapsed if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * elapsed
        log.info(
            "merge fragment=%d version=%d pushes=%d tokens=%d loss=%s (%s) in %.3fs",
            p,
            version,
            len(pending),
            tokens,
            f"{mean_loss:.4f}" if mean_loss else "-",
            reason,
            elapsed,
        )
        self.cond.notify_all()

    def _extend_broadcast(self, frag: FragmentState) -> None:
        """After a merge: what learners will hold next, and the encoded step that gets them there."""
        codec = self.config.sync.pull_codec
        if codec == "fp32":
            frag.broadcast = frag.params
            return
        blobs, new = {}, {}
        for name, theta in frag.params.items():
            target = theta.float() - frag.broadcast[name].float()  # includes what was dropped before
            blob = codecs.encode(target, codec, self.config.sync.codec_level)
            blobs[name] = blob
            new[name] = frag.broadcast[name].float() + codecs.decode(blob, codec, tuple(theta.shape))
        frag.broadcast = new
        frag.chain[frag.version] = blobs
        for old in [v for v in frag.chain if v <= frag.version - self.config.sync.pull_chain]:
            del frag.chain[old]

    def _pull_groups(self, p: int, have: int) -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
        """What a learner holding version `have` of fragment p needs: the encoded steps since, or
        (no version held, or the steps are gone) the full fragment as learners hold it."""
        frag = self.fragments[p]
        steps = range(have + 1, frag.version + 1)
        codec = self.config.sync.pull_codec
        if codec != "fp32" and have >= 0 and all(v in frag.chain for v in steps):
            return [
                (
                    pb.TensorHeader(fragment=p, version=v, delta=True, codec=codec),
                    {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in frag.chain[v].items()},
                )
                for v in steps
            ]
        return [(pb.TensorHeader(fragment=p, version=frag.version, codec="fp32"), frag.broadcast)]

    def _tick_forever(self) -> None:
        """Time-driven events: lease expiry, dead learners, grace windows, the token budget."""
        while not self._stop.wait(0.25):
            try:
                self.tick()
            except Exception:  # a bad tick must not kill the syncer; it is logged and retried
                log.exception("syncer tick failed")

    def tick(self) -> None:
        self.ledger.reclaim_expired(
            self.config.coordinator.lease_ttl_s, self.config.coordinator.max_chunk_attempts
        )
        with self.cond:
            self._close_ready_rounds()
        budget = self.config.train.max_tokens
        # The budget counts tokens merged into the model (the ledger's exact, durable count): work
        # a kill or a restart throws away is not training, and a heartbeat counter restarts with
        # its process.
        if budget and self.run_state == "running" and self.ledger.counter("tokens_merged") >= budget:
            self._set_run_state("finishing", f"token budget of {budget} reached")
        if self.run_state == "finishing" and not self._live_learners():
            with self.cond:
                if not any(f.pending for f in self.fragments):
                    self._set_run_state("finished", "every learner has left")

    def _tokens_reported(self) -> int:
        total = 0
        for w in self.ledger.workers():
            if w["role"] == "compute":
                total += int(json.loads(w["stats"]).get("tokens_trained", 0))
        return total

    # -- operators ------------------------------------------------------------------------------

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        self.wire.add_in("finish", request)
        self._set_run_state("finishing", request.reason or "asked to finish")
        with self.cond:
            self._close_ready_rounds()
        reply = pb.FinishReply(run_state=self._state_pb())
        self.wire.add_out("finish", reply)
        return reply

    def status_detail(self) -> dict[str, Any]:
        summary = self.ledger.summary()
        now = self.clock()
        ttl = self.config.coordinator.lease_ttl_s
        workers = []
        for w in self.ledger.workers():
            stats = json.loads(w["stats"])
            workers.append(
                {
                    "worker_id": w["id"],
                    "role": w["role"],
                    "host": w["host"],
                    "state": w["state"],
                    "last_seen_s": round(now - w["last_seen"], 3),
                    "alive": w["state"] == "active" and now - w["last_seen"] < ttl,
                    **stats,
                }
            )
        wire_in, wire_out = self.wire.totals()
        counters = summary.pop("counters")
        first_loss = self.ledger.get_meta("first_loss")
        return {
            **summary,
            "run_state": self.run_state,
            "coordinator_epoch": self.epoch,
            "fragment_versions": [f.version for f in self.fragments],
            "tokens_merged": int(counters.get("tokens_merged", 0)),
            "tokens_pushed": int(counters.get("tokens_trained", 0)),
            # Heartbeats are current while learners run; pushes are exact once they have left.
            "tokens_trained": max(self._tokens_reported(), int(counters.get("tokens_trained", 0))),
            "pushes_received": int(counters.get("pushes_received", 0)),
            "pushes_refused": int(counters.get("pushes_refused", 0)),
            "record_stats": {
                k.split(".", 1)[1]: int(v) for k, v in counters.items() if k.startswith("records.")
            },
            "first_loss": float(first_loss) if first_loss else None,
            "last_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "wire_bytes_in": wire_in,
            "wire_bytes_out": wire_out,
            "wire_by_rpc": self.wire.by_kind(),
            "workers": workers,
            "uptime_s": round(now - self.started_at, 3),
        }

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        d = self.status_detail()
        reply = pb.StatusReply(
            run_state=self._state_pb(),
            coordinator_epoch=self.epoch,
            chunks_total=d["chunks_total"],
            chunks_done=d["chunks_done"],
            chunks_quarantined=d["chunks_quarantined"],
            shards_total=d["shards_total"],
            shards_consumed=d["shards_consumed"],
            tokens_prepared=d["tokens_prepared"],
            tokens_merged=d["tokens_merged"],
            tokens_trained=d["tokens_trained"],
            rounds=d["rounds"],
            fragment_versions=d["fragment_versions"],
            last_loss=d["last_loss"] or 0.0,
            first_loss=d["first_loss"] or 0.0,
            wire_bytes_in=d["wire_bytes_in"],
            wire_bytes_out=d["wire_bytes_out"],
            pushes_accepted=d["pushes_received"],
            pushes_refused=d["pushes_refused"],
            workers=[
                pb.WorkerStatus(
                    worker_id=w["worker_id"],
                    role=next(k for k, v in ROLE_NAMES.items() if v == w["role"]),
                    host=w["host"],
                    last_seen_s=w["last_seen_s"],
                    alive=w["alive"],
                    inner_steps=int(w.get("inner_steps", 0)),
                    tokens_trained=int(w.get("tokens_trained", 0)),
                    last_loss=float(w.get("last_loss", 0.0)),
                    busy_seconds=float(w.get("busy_seconds", 0.0)),
                    wall_seconds=float(w.get("wall_seconds", 0.0)),
                )
                for w in d["workers"]
            ],
            detail_json=json.dumps(d),
        )
        return reply
