"""The coordinator's gRPC service: membership, leases, the syncer, checkpoints, status.

State that must survive a crash lives in the ledger (committed before an RPC answers) and in the
checkpoint files; what lives only here is the open round of each fragment (its pushes' tensors)
and merges not yet published, which a crash drops — the ledger then marks those pushes dropped,
and their rows go back to the pool.

Merging and publishing are two steps. A round merges in memory at once (the next merge builds on
it); a publisher thread then writes the fragment's checkpoint and commits the merge in the ledger,
and only then may learners pull it. When merges come faster than the store takes checkpoints,
the publisher writes the newest state once and commits every merge since in one transaction:
merge throughput is then bound by arithmetic, not by the store, and nothing a learner holds was
ever lost by a crash. Decisions (quorum, grace window, merge, outer step, lease expiry) are the pure functions of
syncer.py and leases.py; this module only applies them under one lock.
"""

from __future__ import annotations

import itertools
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
from diloco.coordinator import checkpoint, deal, syncer
from diloco.coordinator.ledger import ChunkLease, Ledger, MergeRecord, ShardLease
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
_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# Client streams whose messages are counted as gRPC reads them (wirecount.CountRequestStreams).
STREAMED_REQUEST_KINDS = {f"/{_SERVICE}/PushDelta": "push", f"/{_SERVICE}/InitParameters": "init"}
MAX_PULL_WAIT_S = 30.0
PUSH_SLOT_WAIT_S = 10.0


@dataclass
class PendingPush:
    arrival: syncer.Arrival
    push_id: str
    mean_loss: float
    first_loss: float


@dataclass
class RoundSum:
    """The open round's deltas, folded in by the push handlers as they are accepted, so the
    coordinator holds one fragment per round however many learners push (plus the pushes in
    flight, which max_inflight_pushes bounds). `folding` handlers are still adding theirs."""

    acc: syncer.MergeAccumulator
    lock: threading.Lock = field(default_factory=threading.Lock)
    folding: int = 0
    lost: list[str] = field(default_factory=list)  # push ids whose fold failed: the round is dropped


@dataclass
class FragmentState:
    index: int
    names: list[str]
    # The head: the newest merge, in memory (published or not); the next merge builds on it.
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    version: int
    round: syncer.RoundState
    sum: RoundSum
    pending: list[PendingPush] = field(default_factory=list)
    sealing: bool = False  # the merger is waiting for the round's last folds: new pushes wait
    # The last merged round's first push time and pushers: a push that opens the next round is
    # told how late it was for that one (syncer.missed_round_by).
    previous_round: tuple[float, frozenset[str]] | None = None
    # Published: checkpointed and committed, so learners may hold it. Merges between the
    # published version and the head wait for the publisher.
    published_version: int = 0
    unpublished: list[MergeRecord] = field(default_factory=list)
    files: list[int] = field(default_factory=list)  # versions with a checkpoint file, oldest first
    # What up-to-date learners hold: published Θ itself with fp32 pulls; with a pull codec, the
    # sum of the encoded deltas sent so far. Θ − broadcast is the coordinator's error feedback: it
    # goes out with the next delta, so the learners' copy never drifts from Θ.
    broadcast: dict[str, torch.Tensor] = field(default_factory=dict)
    # published version -> (the published version before it, the encoded blobs of the step
    # between their broadcasts), the last few.
    chain: dict[int, tuple[int, dict[str, bytes]]] = field(default_factory=dict)


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
        tokenizer_hash: str = "",
    ):
        self.config = config
        self.ledger = ledger
        # Handed out at join; every worker refuses to work with a tokenizer that differs.
        self.tokenizer_hash = tokenizer_hash
        self.run_id = self.ledger.run_id()
        self.checkpoint_root = checkpoint_root
        self.shard_root = shard_root
        self.clock = clock
        self.policy = policy_of(config)
        self.cond = threading.Condition(threading.RLock())
        self.wire = WireCounter()
        self._roles: dict[str, str] = {}  # worker id -> role, for counting bytes per role
        self._initializing: str | None = None  # "being initialized by <worker>" while an init streams
        self._deal_slots: dict[str, int] = {}  # learner -> its deal slot (data.deal > 0)
        self._push_slots = threading.BoundedSemaphore(config.coordinator.max_inflight_pushes)
        self.epoch = ledger.next_epoch()
        self.run_state = ledger.get_meta("run_state", "running") or "running"
        self.started_at = clock()
        self.fragments: list[FragmentState] = []
        self.specs: dict[str, pb.TensorSpec] = {}
        self.step_time_s = 0.0  # EMA of learners' reported inner step time
        self.sync_time_s = 0.0  # EMA of merge duration
        self.publish_time_s = 0.0  # EMA of writing a checkpoint and committing its merges
        self.last_loss = math.nan
        self._load_parameters()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_forever, name="syncer-tick", daemon=True)
        self._publisher = threading.Thread(target=self._publish_forever, name="publisher", daemon=True)
        self._merger = threading.Thread(target=self._merge_forever, name="merger", daemon=True)

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._ticker.start()
        self._merger.start()
        self._publisher.start()

    def stop(self, publish_timeout_s: float = 60.0) -> None:
        """Stop the clocks; merges already made are published first (bounded in time)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        for thread in (self._ticker, self._merger):
            if thread.is_alive():
                thread.join(timeout=5)
        if self._publisher.is_alive():
            self._publisher.join(timeout=publish_timeout_s)

    def wait_published(self, timeout_s: float = 30.0) -> bool:
        """Until every push received so far is merged and published (for tools and tests)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(f.pending or f.unpublished for f in self.fragments):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.25))
        return True

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
        return FragmentState(
            p, names, params, momentum, version, round_, self._new_sum(), published_version=version,
            files=[version], broadcast=params,
        )  # fmt: skip

    def _new_sum(self) -> RoundSum:
        return RoundSum(syncer.MergeAccumulator(self.policy.merge))

    # -- helpers --------------------------------------------------------------------------------

    def _state_pb(self) -> int:
        return RUN_STATES[self.run_state]

    def _require_worker(self, worker_id: str, context: grpc.ServicerContext) -> None:
        if not worker_id or not self.ledger.known_worker(worker_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {worker_id!r}: join first")

    def _role_of(self, worker_id: str) -> str:
        role = self._roles.get(worker_id)
        if role is None:
            role = self.ledger.worker_role(worker_id) or "unknown"
            self._roles[worker_id] = role
        return role

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
        role = ROLE_NAMES.get(request.role)
        self.wire.unary_in("join", request, role)
        if role is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "join needs a role")
        worker_id = request.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.ledger.join(worker_id, role, request.host or "?")
        self._roles[worker_id] = role
        log.info("join worker=%s role=%s host=%s", worker_id, role, request.host)
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

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        role = self._role_of(request.worker_id)
        self.wire.unary_in("heartbeat", request, role)
        self._require_worker(request.worker_id, context)
        stats = {
            "inner_steps": request.inner_steps,
            "tokens_trained": request.tokens_trained,
            "last_loss": request.last_loss,
            "busy_seconds": request.busy_seconds,
            "kept_busy_seconds": request.kept_busy_seconds,
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
        self.wire.add_out("heartbeat", reply, role)
        return reply

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        role = self._role_of(request.worker_id)
        self.wire.unary_in("leave", request, role)
        self.ledger.leave(request.worker_id)
        log.info("leave worker=%s reason=%s", request.worker_id, request.reason or "-")
        with self.cond:
            self.cond.notify_all()  # one learner fewer: the merger may close a round now
        reply = pb.LeaveReply()
        self.wire.add_out("leave", reply, role)
        return reply

    # -- data workers ---------------------------------------------------------------------------

    def LeaseChunk(self, request: pb.LeaseChunkRequest, context: grpc.ServicerContext) -> pb.LeaseChunkReply:
        self.wire.unary_in("lease_chunk", request)
        self._require_worker(request.worker_id, context)
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseChunkReply(done=True, run_state=self._state_pb())
        else:
            lease = self.ledger.lease_chunk(
                request.worker_id,
                ttl,
                self.config.coordinator.max_chunk_attempts,
                self.config.data.max_ready_shards,
                self.config.data.deal,
            )
            if isinstance(lease, ChunkLease):
                shard_uri = store.join(self.shard_root, f"chunk-{lease.chunk_id:06d}-a{lease.attempt}.shard")
                reply = pb.LeaseChunkReply(
                    chunk_id=lease.chunk_id,
                    split=lease.spec.split,
                    shard_uri=shard_uri,
                    lease_ttl_s=ttl,
                    segments=[
                        pb.Segment(
                            uri=s.uri,
                            start=s.start,
                            end=s.end,
                            file_end=s.file_end,
                            unit=s.unit,
                            nbytes=s.nbytes,
                        )
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
        self.wire.unary_in("complete_chunk", request)
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
        if done.accepted and done.reason != "already recorded":  # a retried completion counts once
            # Each data worker's throughput, for status and summary.json: tokens it wrote into
            # recorded shards, and the seconds it spent on those chunks.
            self.ledger.bump(f"data_tokens.{request.worker_id}", request.tokens)
            self.ledger.bump(f"data_seconds.{request.worker_id}", request.seconds)
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
        self.wire.unary_in("fail_chunk", request)
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
        self.wire.unary_in("lease_shard", request)
        self._require_worker(request.worker_id, context)
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
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
            elif lease in ("wait", "wait-dealt"):
                reply = pb.LeaseShardReply(
                    retry_after_s=0.5, run_state=self._state_pb(), dealt_shard_coming=lease == "wait-dealt"
                )
            else:
                reply = pb.LeaseShardReply(done=True, run_state=self._state_pb())
        self.wire.add_out("lease_shard", reply)
        return reply

    def ReportShard(
        self, request: pb.ReportShardRequest, context: grpc.ServicerContext
    ) -> pb.ReportShardReply:
        self.wire.unary_in("report_shard", request)
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
        self.wire.call("init")  # its messages are counted as gRPC reads them (CountRequestStreams)
        messages = iter(request_iterator)
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad init stream: it must start with a header")
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
        # A learner that holds nothing yet pays a one-time join cost: counted apart, so the
        # steady-state bytes per token can be told from it.
        held = list(request.have_versions)
        kind = "pull" if held and all(v >= 0 for v in held) else "pull_join"
        self.wire.unary_in(kind, request)
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
        yield from self.wire.count_out(kind, stream_many(groups, piece))

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
        self.wire.call("push")  # its messages are counted as gRPC reads them (CountRequestStreams)
        messages = iter(request_iterator)
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
            merged_at = prior["merged_version"] or self._unpublished_merge_of(header.fragment, header.push_id)
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
            if header.tokens == 0 or header.inner_steps == 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a delta must report its steps and tokens")
        else:
            for _ in messages:
                pass

        with self.cond:
            reply, fold = self._accept_push(header, tensors, empty)
            self.cond.notify_all()  # the merger decides; pushes that come while it merges join the next round
        if fold is not None:
            self._fold(header, tensors, *fold)
        # Learners push every H/P steps but heartbeat every few seconds: told here, they stop
        # within a push interval of the budget instead of training on for a heartbeat period.
        reply.run_state = self._state_pb()
        self.wire.add_out("push", reply)
        return reply

    def _fold(
        self, header: pb.TensorHeader, tensors: dict[str, torch.Tensor], into: RoundSum, weight: float
    ) -> None:
        """Add an accepted push into its round's sum, outside the service lock (pushes fold in
        parallel with each other and with receiving); the merger waits for every fold of a round."""
        try:
            with into.lock:
                into.acc.add(tensors, weight, consume=True)
        except Exception:  # recorded as pending, not in the sum: the merge must drop it, not count it
            log.exception("folding push %s failed; it will be dropped", header.push_id)
            into.lost.append(header.push_id)
        finally:
            with self.cond:
                into.folding -= 1
                self.cond.notify_all()

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
        # fp32 values are checked for NaN/inf piece by piece; decoded codecs check their own output.
        asm = TensorAssembler(header, self.config.coordinator.max_push_bytes, expected, finite=True)
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
    ) -> tuple[pb.PushReply, tuple[RoundSum, float] | None]:
        """Record a push in its round (lock held); returns the reply, and for a delta to merge,
        the round's sum to fold it into with its weight."""
        frag = self.fragments[header.fragment]
        while frag.sealing:  # the merger is closing this round: join the next one
            self.cond.wait(0.05)
        released = list(header.released_shards)
        if empty:
            # "Nothing this round" (a learner waiting for data): counts for closing, merges nothing.
            self.ledger.release_shards(header.worker_id, released)
            frag.round.arrivals[:] = [
                a for a in frag.round.arrivals if not (a.worker_id == header.worker_id and a.tokens == 0)
            ]
            frag.round.arrivals.append(syncer.Arrival(header.worker_id, 0, 0, self.clock(), header.version))
            return pb.PushReply(accepted=True, reason="nothing to merge", version=frag.version), None
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
            return pb.PushReply(accepted=False, reason=refusal, version=frag.version), None
        now = self.clock()
        missed = 0.0
        if frag.previous_round is not None and not any(a.tokens for a in frag.round.arrivals):
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
            self.step_time_s = (
                header.step_time_s
                if self.step_time_s == 0
                else 0.8 * self.step_time_s + 0.2 * header.step_time_s
            )
        if header.first_loss and self.ledger.get_meta("first_loss") is None:
            self.ledger.set_meta(first_loss=repr(header.first_loss))
        weight = syncer.merge_weight(header.tokens, header.inner_steps, self.policy.merge)
        reply = pb.PushReply(
            accepted=True, reason="queued for merge", version=frag.version, missed_round_by_s=missed
        )
        return reply, (frag.sum, weight)

    # -- the syncer -----------------------------------------------------------------------------

    def _merge_forever(self) -> None:
        """Close rounds as pushes arrive. One thread merges, so pushes that arrive while a merge
        runs wait in the next round and merge together: under load, one outer step takes many
        deltas instead of each push paying for its own."""
        with self.cond:
            while not self._stop.is_set():
                try:
                    self._close_ready_rounds()
                except Exception:  # a bad merge must not stop the syncer; it is tried again
                    log.exception("merge failed")
                self.cond.wait(0.25)  # pushes, leaves and finishing wake it; grace windows run out

    def _close_ready_rounds(self) -> None:
        """Merge every fragment whose round the pure decision says is ready (lock held)."""
        if not self.fragments:
            return
        live = self._live_learners()
        now = self.clock()
        for frag in self.fragments:
            decision = syncer.decide_close(
                frag.round, now, self.policy, live, self.step_time_s, self.sync_time_s + self.publish_time_s
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
        # Seal the round: its last accepted pushes may still be adding into the sum.
        frag.sealing = True
        try:
            while frag.sum.folding:
                self.cond.wait(0.05)
        finally:
            frag.sealing = False
        summed = frag.sum
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
        scale = syncer.coverage_scale(len(contributors), len(contributors | set(self._live_learners())))
        outer_grad = summed.acc.result(scale)
        params, momentum = syncer.outer_step(
            frag.params,
            frag.momentum,
            outer_grad,
            self.policy.outer_lr,
            self.policy.outer_momentum,
            self.policy.nesterov,
            fraction=scale,
            consume=True,
        )
        version = frag.version + 1
        tokens = sum(q.arrival.tokens for q in pending)
        steps = sum(q.arrival.steps for q in pending)
        losses = [q.mean_loss for q in pending if q.mean_loss > 0]
        mean_loss = sum(losses) / len(losses) if losses else None
        frag.unpublished.append(
            MergeRecord(version, tuple(q.push_id for q in pending), tokens, steps, mean_loss, reason, scale)
        )
        frag.params, frag.momentum, frag.version = params, momentum, version
        frag.previous_round = (min(q.arrival.arrived_at for q in pending), frozenset(contributors))
        frag.pending, frag.sum = [], self._new_sum()
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
        self.cond.notify_all()  # the publisher

    def _unpublished_merge_of(self, fragment: int, push_id: str) -> int | None:
        with self.cond:
            for merge in self.fragments[fragment].unpublished:
                if push_id in merge.push_ids:
                    return merge.version
        return None

    # -- the publisher --------------------------------------------------------------------------

    def _publish_forever(self) -> None:
        """Checkpoint and commit merges off the RPC threads, every waiting merge at once."""
        failures = 0
        while True:
            with self.cond:
                ready = [(f, f.params, f.momentum, f.version) for f in self.fragments if f.unpublished]
                if not ready:
                    if self._stop.is_set():
                        return
                    self.cond.wait(0.25)
                    continue
            try:
                started = time.monotonic()
                for frag, params, momentum, version in ready:
                    self._publish(frag, params, momentum, version)
                failures = 0
                # Under a burst of merges, space the checkpoints out: the merges in between are
                # published together, one file and one commit (ingest + merge ran 48% -> 55% of raw
                # streaming in benchmarks/ingest.py). When merges are sparse this waits for nothing.
                spacing = self.config.coordinator.min_publish_interval_s - (time.monotonic() - started)
                if spacing > 0:
                    self._stop.wait(spacing)
            except Exception:  # a store hiccup: the merges stay in memory and are tried again
                failures += 1
                log.exception("publishing merges failed (%d in a row); retrying", failures)
                if self._stop.is_set() and failures >= 5:
                    log.error("giving up publishing at shutdown: the last merges are lost")
                    return
                time.sleep(min(5.0, 0.2 * 2**failures))

    def _publish(
        self,
        frag: FragmentState,
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor],
        version: int,
    ) -> None:
        started = time.monotonic()
        p = frag.index
        # The file is complete on the store before the ledger points at it.
        checkpoint.save_fragment(self.checkpoint_root, p, version, params, momentum)
        with self.cond:
            merges = [m for m in frag.unpublished if m.version <= version]
            self.ledger.commit_merges(p, merges)
            frag.unpublished = [m for m in frag.unpublished if m.version > version]
            self._extend_broadcast(frag, params, version)
            frag.published_version = version
            frag.files.append(version)
            # The version before the published one stays as a fallback.
            obsolete, frag.files = frag.files[:-2], frag.files[-2:]
            self.cond.notify_all()
        for old in obsolete:
            checkpoint.remove_fragment(self.checkpoint_root, p, old)
        elapsed = time.monotonic() - started
        self.publish_time_s = (
            elapsed if self.publish_time_s == 0 else 0.8 * self.publish_time_s + 0.2 * elapsed
        )
        if len(merges) > 1:
            log.info("published fragment=%d version=%d (%d merges at once)", p, version, len(merges))

    def _extend_broadcast(self, frag: FragmentState, params: dict[str, torch.Tensor], version: int) -> None:
        """On publishing `version`: what learners will hold next, and the encoded step there."""
        codec = self.config.sync.pull_codec
        if codec == "fp32":
            frag.broadcast = params
            return
        blobs, new = {}, {}
        for name, theta in params.items():
            blobs[name], new[name] = codecs.encode_step(
                theta, frag.broadcast[name], codec, self.config.sync.codec_level
            )
        frag.broadcast = new
        frag.chain[version] = (frag.published_version, blobs)
        for old in sorted(frag.chain)[: -self.config.sync.pull_chain]:
            del frag.chain[old]

    def _pull_groups(self, p: int, have: int) -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
        """What a learner holding version `have` of fragment p needs: the encoded steps since, or
        (no version held, or the steps are gone) the full fragment as learners hold it."""
        frag = self.fragments[p]
        codec = self.config.sync.pull_codec
        if codec != "fp32" and have >= 0:
            steps: list[tuple[int, dict[str, bytes]]] = []
            v = frag.published_version
            while v > have and v in frag.chain:  # walk the chain back to the version held
                base, blobs = frag.chain[v]
                steps.append((v, blobs))
                v = base
            if v == have:
                return [
                    (
                        pb.TensorHeader(fragment=p, version=v, delta=True, codec=codec),
                        {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in blobs.items()},
                    )
                    for v, blobs in reversed(steps)
                ]
        return [(pb.TensorHeader(fragment=p, version=frag.published_version, codec="fp32"), frag.broadcast)]

    def _tick_forever(self) -> None:
        """Time-driven events: lease expiry, the token budget, the end of the run. (Grace windows
        and learners found dead close rounds in the merger, which wakes at least every 0.25 s.)"""
        while not self._stop.wait(0.25):
            try:
                self.tick()
            except Exception:  # a bad tick must not kill the syncer; it is logged and retried
                log.exception("syncer tick failed")

    def tick(self) -> None:
        self.ledger.reclaim_expired(
            self.config.coordinator.lease_ttl_s, self.config.coordinator.max_chunk_attempts
        )
        budget = self.config.train.max_tokens
        # The budget counts tokens merged into the model (the ledger's exact, durable count): work
        # a kill or a restart throws away is not training, and a heartbeat counter restarts with
        # its process.
        if budget and self.run_state == "running" and self.ledger.counter("tokens_merged") >= budget:
            self._set_run_state("finishing", f"token budget of {budget} reached")
        if self.run_state == "finishing" and not self._live_learners():
            with self.cond:
                if not any(f.pending or f.unpublished for f in self.fragments):
                    self._set_run_state("finished", "every learner has left")

    def _tokens_reported(self) -> int:
        """Tokens the learners say they trained: each one's latest count, plus the last counts of
        earlier lives of restarted learners (work a kill threw away was still trained)."""
        total = int(self.ledger.counter("tokens_trained_by_earlier_lives"))
        for w in self.ledger.workers():
            if w["role"] == "compute":
                total += int(json.loads(w["stats"]).get("tokens_trained", 0))
        return total

    # -- operators ------------------------------------------------------------------------------

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        self.wire.unary_in("finish", request)
        self._set_run_state("finishing", request.reason or "asked to finish")  # wakes the merger
        reply = pb.FinishReply(run_state=self._state_pb())
        self.wire.add_out("finish", reply)
        return reply

    @staticmethod
    def _data_worker_rates(worker_id: str, counters: dict[str, float]) -> dict[str, Any]:
        tokens = int(counters.get(f"data_tokens.{worker_id}", 0))
        seconds = float(counters.get(f"data_seconds.{worker_id}", 0.0))
        return {
            "tokens_prepared": tokens,
            "prepare_seconds": round(seconds, 3),
            # While working on chunks (read, tokenize, pack, compress, write): one process's speed.
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        }

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
                    **(self._data_worker_rates(w["id"], summary["counters"]) if w["role"] == "data" else {}),
                }
            )
        wire_in, wire_out = self.wire.totals()
        counters = summary.pop("counters")
        first_loss = self.ledger.get_meta("first_loss")
        return {
            **summary,
            "run_state": self.run_state,
            "coordinator_epoch": self.epoch,
            "fragment_versions": [f.published_version for f in self.fragments],
            "tokens_merged": int(counters.get("tokens_merged", 0)),
            "tokens_pushed": int(counters.get("tokens_trained", 0)),
            # Heartbeats are current while learners run; pushes are exact once they have left.
            "tokens_trained": max(self._tokens_reported(), int(counters.get("tokens_trained", 0))),
            # Time in inner steps over every life of every learner (heartbeats; earlier lives kept).
            "learner_busy_seconds": round(
                counters.get("busy_seconds_by_earlier_lives", 0.0)
                + sum(w.get("busy_seconds", 0.0) for w in workers if w["role"] == "compute"),
                3,
            ),
            # Of it, the steps whose work survived: carried by pushes or saved on local disk.
            "learner_kept_busy_seconds": round(
                counters.get("kept_busy_seconds_by_earlier_lives", 0.0)
                + sum(w.get("kept_busy_seconds", 0.0) for w in workers if w["role"] == "compute"),
                3,
            ),
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
            "wire_by_role": self.wire.by_role(),
            "workers": workers,
            "uptime_s": round(now - self.started_at, 3),
        }

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self.wire.unary_in("status", request)
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
        self.wire.add_out("status", reply)
        return reply
