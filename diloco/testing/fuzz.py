"""A Hypothesis state machine that drives a real coordinator over gRPC with random sequences of
valid and malformed calls from several identities (tests/unit/security/test_fuzz.py runs a few
hundred; benchmarks/fuzz.py runs ten thousand and more). Test tooling: it needs hypothesis (dev).

After every call: the coordinator answered with a result or a refusal, never an internal error
(no crash); the global parameters are finite; a push it refused is never merged. At the end of a
run the ledger's audit passes. Calls go through the raw stubs (no client retries), each with a
short deadline.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pb_grpc
from diloco.wire.tensors import stream_tensors

# Codes a refusal may carry. Anything else (UNKNOWN, INTERNAL, ...) is a crash in a handler.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
}  # fmt: skip
IDENTITIES = {
    "learner-a": pb.ROLE_COMPUTE,
    "learner-b": pb.ROLE_COMPUTE,
    "data-a": pb.ROLE_DATA,
    "stranger": 0,
}
PUSH_KINDS = ["valid", "nan", "inf", "huge_values", "wrong_shape", "wrong_name", "huge_tokens", "no_rows",
              "unknown_fragment", "stale", "wrong_codec", "empty"]  # fmt: skip
COUNTERS = [1.0, 0.0, -1.0, math.nan, math.inf, 2.0**60]


@dataclass
class Tally:
    """What the fuzzer did, for the benchmark's report."""

    calls: int = 0
    refused: int = 0
    accepted_pushes: int = 0
    refused_pushes: int = 0
    by_call: dict[str, int] = field(default_factory=dict)


def make_machine(running: Any, init: dict[str, torch.Tensor], tally: Tally) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one running coordinator (shared by every example: the
    invariants are the service's, whatever came before)."""
    address = f"127.0.0.1:{running.port}"
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    service = running.service
    names = [n for f in service.fragments for n in f.names]

    class ServiceFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.held: dict[str, list[int]] = {i: [] for i in IDENTITIES}  # shard leases per identity
            self.refused_push_ids: list[str] = []

        # -- the call, and what a refusal is -----------------------------------------------

        def call(self, what: str, fn: Any) -> Any:
            tally.calls += 1
            tally.by_call[what] = tally.by_call.get(what, 0) + 1
            try:
                return fn()
            except grpc.RpcError as e:
                assert e.code() in REFUSALS, f"{what}: {e.code()} {e.details()}"  # a crash, not a refusal
                tally.refused += 1
                return None

        # -- rules ---------------------------------------------------------------------------

        @rule(who=st.sampled_from(sorted(IDENTITIES)))
        def join(self, who: str) -> None:
            role = IDENTITIES[who]
            self.call(
                "join", lambda: stub.Join(pb.JoinRequest(role=role, host="fuzz", worker_id=who), timeout=5)
            )

        @rule(who=st.sampled_from(sorted(IDENTITIES)), value=st.sampled_from(COUNTERS),
              device=st.sampled_from(["cpu", "x" * 300, "bad\x00"]))  # fmt: skip
        def heartbeat(self, who: str, value: float, device: str) -> None:
            request = pb.HeartbeatRequest(
                worker_id=who, inner_steps=int(value) if math.isfinite(value) and 0 <= value < 2**63 else 0,
                busy_seconds=value, wall_seconds=value, last_loss=value, device=device,
                shard_leases=self.held[who], train_metrics={"acc": value},
            )  # fmt: skip
            self.call("heartbeat", lambda: stub.Heartbeat(request, timeout=5))

        @rule(who=st.sampled_from(sorted(IDENTITIES)))
        def lease_shard(self, who: str) -> None:
            reply = self.call(
                "lease_shard", lambda: stub.LeaseShard(pb.LeaseShardRequest(worker_id=who), timeout=5)
            )
            if reply is not None and reply.shard_id:
                self.held[who].append(reply.shard_id)

        @rule(who=st.sampled_from(sorted(IDENTITIES)), kind=st.sampled_from(PUSH_KINDS),
              rows=st.integers(0, 40))  # fmt: skip
        def push(self, who: str, kind: str, rows: int) -> None:
            frag = service.fragments[0] if service.fragments else None
            version = frag.version if frag is not None else 0
            header = pb.TensorHeader(
                worker_id=who, fragment=99 if kind == "unknown_fragment" else 0,
                version=max(0, version - 100) if kind == "stale" else version, codec="int8" if kind == "wrong_codec" else "fp32",
                inner_steps=1, tokens=(1 << 60) if kind == "huge_tokens" else 129 * max(1, rows),
                push_id=uuid.uuid4().hex, mean_loss=1.0,
            )  # fmt: skip
            if self.held[who] and kind != "no_rows":
                header.spans.add(shard_id=self.held[who][0], row_start=0, row_end=max(1, rows))
            tensors = {n: torch.randn_like(t) * 1e-3 for n, t in init.items() if n in names}
            if kind == "nan":
                next(iter(tensors.values())).view(-1)[0] = math.nan
            elif kind == "inf":
                next(iter(tensors.values())).view(-1)[0] = math.inf
            elif kind == "huge_values":
                tensors = {n: torch.full_like(t, 1e30) for n, t in tensors.items()}
            elif kind == "wrong_shape":
                n = next(iter(tensors))
                tensors[n] = torch.zeros(3, 3)
            elif kind == "wrong_name":
                tensors["not.a.parameter"] = tensors.pop(next(iter(tensors)))
            elif kind == "empty":
                tensors, header.tokens = {}, 0
            if frag is not None:
                tensors = {n: t for n, t in tensors.items() if n in frag.names or n == "not.a.parameter"}
            reply = self.call(
                "push", lambda: stub.PushDelta(stream_tensors(header, tensors, 1 << 20), timeout=10)
            )  # fmt: skip
            if reply is None or not reply.accepted:
                tally.refused_pushes += 1
                self.refused_push_ids.append(header.push_id)
            else:
                tally.accepted_pushes += 1

        @rule(who=st.sampled_from(sorted(IDENTITIES)))
        def lease_chunk(self, who: str) -> None:
            self.call("lease_chunk", lambda: stub.LeaseChunk(pb.LeaseChunkRequest(worker_id=who), timeout=5))

        @rule(who=st.sampled_from(sorted(IDENTITIES)), have=st.integers(-1, 3))
        def pull(self, who: str, have: int) -> None:
            request = pb.PullRequest(worker_id=who, fragments=[0], have_versions=[have], wait_s=0.0)
            self.call("pull", lambda: list(stub.PullParameters(request, timeout=10)))

        @rule(who=st.sampled_from(sorted(IDENTITIES)), chunk=st.integers(0, 200),
              uri=st.sampled_from(["/etc/passwd", "../x", "", "s3://elsewhere/a"]),
              count=st.sampled_from([0, 1, 1 << 62]))  # fmt: skip
        def complete_chunk(self, who: str, chunk: int, uri: str, count: int) -> None:
            request = pb.CompleteChunkRequest(worker_id=who, chunk_id=chunk, completion_id=uuid.uuid4().hex,
                                              shard_uri=uri, rows=count, tokens=count, checksum="0" * 64)  # fmt: skip
            self.call("complete_chunk", lambda: stub.CompleteChunk(request, timeout=5))

        @rule(who=st.sampled_from(sorted(IDENTITIES)), chunk=st.integers(0, 200))
        def fail_chunk(self, who: str, chunk: int) -> None:
            request = pb.FailChunkRequest(worker_id=who, chunk_id=chunk, error="x" * 5000)
            self.call("fail_chunk", lambda: stub.FailChunk(request, timeout=5))

        @rule(who=st.sampled_from(sorted(IDENTITIES)), shard=st.integers(0, 50))
        def report_shard(self, who: str, shard: int) -> None:
            request = pb.ReportShardRequest(worker_id=who, shard_id=shard, error="fuzz")
            self.call("report_shard", lambda: stub.ReportShard(request, timeout=5))

        @rule(who=st.sampled_from(sorted(IDENTITIES)))
        def leave(self, who: str) -> None:
            self.held[who] = []
            self.call("leave", lambda: stub.Leave(pb.LeaveRequest(worker_id=who, reason="fuzz"), timeout=5))

        # -- invariants -------------------------------------------------------------------------

        @invariant()
        def answers_status(self) -> None:
            assert stub.Status(pb.StatusRequest(), timeout=10) is not None

        @invariant()
        def parameters_are_finite(self) -> None:
            for f in service.fragments:
                for n, t in f.params.items():
                    assert torch.isfinite(t).all(), f"{n} is not finite"

        @invariant()
        def refused_pushes_never_merge(self) -> None:
            for push_id in self.refused_push_ids[-20:]:
                state = running.ledger.push_state(push_id)
                assert state is None or state["state"] != "merged", (push_id, state)

    return ServiceFuzz


def fuzz_overrides() -> dict[str, object]:
    """The coordinator the fuzzer drives: a short staleness bound (stale pushes are refused
    early), data for many epochs (shards to lease for the whole run), leases that outlive its
    pauses between calls."""
    return {"sync.max_staleness": 4, "data.epochs": 50, "coordinator.lease_ttl_s": 30.0}


def audit_ok(workdir: Path) -> list[str]:
    from diloco.coordinator.audit import audit

    return audit(workdir).violations
