"""A Hypothesis state machine that drives a real coordinator over gRPC with random sequences of
valid and malformed calls from several identities (tests/unit/security/test_fuzz.py runs a few
hundred; benchmarks/fuzz.py runs ten thousand and more). Test tooling: it needs hypothesis (dev).

After every call: the coordinator answered with a result or a refusal, never an internal error
(no crash); the global parameters are finite; a push it refused is never merged; InitParameters
(from anyone, after the first) changes nothing. At the end of a run the ledger's audit passes.
Calls go through the raw stubs (no client retries), each with a short deadline.

With certificates (`channels`: one mutual-TLS channel per identity, from `diloco certs`), each call
is made by one identity and may act as another (its request's worker id): a call from a stranger
(a certificate of another CA), as someone else, or from a role the policy below does not allow
must be refused, and a refused one must leave workers and leases as they were. The policy is
written out here again, from the issue, so the guard is checked against it and not against itself.
"""

from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from diloco.security.certs import init_ca, issue
from diloco.security.transport import Security
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
OTHER_HOST = ("learner-b", "stranger")  # plaintext with two hosts: these call from ::1
PUSH_KINDS = ["valid", "nan", "inf", "huge_values", "wrong_shape", "wrong_name", "huge_tokens", "no_rows",
              "unknown_fragment", "stale", "wrong_codec", "empty"]  # fmt: skip
COUNTERS = [1.0, 0.0, -1.0, math.nan, math.inf, 2.0**60]
# With certificates: each identity's role, and what each role may call (issue 14's policy).
CERT_ROLES = {"learner-a": "learner", "learner-b": "learner", "data-a": "data", "watcher": "observer",
              "ops": "operator"}  # fmt: skip
ANYONE = {"join", "heartbeat", "leave", "status"}
MAY_CALL = {
    "learner": ANYONE | {"lease_shard", "report_shard", "push", "pull", "init"},
    "data": ANYONE | {"lease_chunk", "complete_chunk", "fail_chunk"},
    "observer": ANYONE,
    "operator": ANYONE | {"finish"},
}
JOINS_AS = {"learner": pb.ROLE_COMPUTE, "data": pb.ROLE_DATA, "observer": pb.ROLE_OBSERVER,
            "operator": pb.ROLE_OBSERVER}  # fmt: skip
JOIN_ROLES = [pb.ROLE_COMPUTE, pb.ROLE_DATA, pb.ROLE_OBSERVER]
# The worker id a call acts as: mostly the caller's own (""), else any other identity's.
ACTING = st.one_of(st.just(""), st.just(""), st.sampled_from(sorted({*IDENTITIES, *CERT_ROLES})))


@dataclass
class Tally:
    """What the fuzzer did, for the benchmark's report."""

    calls: int = 0
    refused: int = 0
    accepted_pushes: int = 0
    refused_pushes: int = 0
    must_refuse: int = 0  # calls the policy forbids (all of them were refused)
    by_call: dict[str, int] = field(default_factory=dict)


def make_machine(
    running: Any,
    init: dict[str, torch.Tensor],
    tally: Tally,
    channels: dict[str, grpc.Channel] | None = None,
    two_hosts: bool = False,
) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one running coordinator (shared by every example: the
    invariants are the service's, whatever came before). `channels`: caller -> its mTLS channel,
    for every name in CERT_ROLES and "stranger"; none, every call goes in plaintext. With
    `two_hosts` (plaintext, a coordinator listening on localhost), learner-b and the stranger call
    from ::1 and the others from 127.0.0.1: a worker id belongs to the host that joined it, and a
    call from the other host as a live worker of this one must be refused."""
    secure = channels is not None
    channels = channels or {}
    plain = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    stubs = {who: pb_grpc.CoordinatorStub(c) for who, c in channels.items()}
    host_of = {who: "::1" if who in OTHER_HOST and two_hosts else "127.0.0.1" for who in IDENTITIES}
    if two_hosts and not secure:
        other = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"[::1]:{running.port}"))
        stubs.update({who: other for who in OTHER_HOST})
    owner: dict[str, str] = {}  # worker id -> the host that joined it (plaintext, two hosts)
    live: set[str] = set()  # joined and not left (leases outlive the run: fuzz_overrides)
    stub = stubs.get("watcher", plain)  # the invariants' own calls: an observer's
    callers = sorted(channels) if secure else sorted(IDENTITIES)
    service = running.service
    names = [n for f in service.fragments for n in f.names]

    def forbidden(what: str, who: str, acting: str, joins_as: int | None = None) -> bool:
        """Whether the policy forbids this call: with certificates, by role and name; without,
        acting as a live worker another host joined."""
        role = CERT_ROLES.get(who)
        if not secure:
            worker = acting or who
            taken = worker in live and owner.get(worker, host_of[who]) != host_of[who]
            return taken and what not in ("status", "finish")
        if role is None or what not in MAY_CALL[role] or (acting and acting != who):
            return True
        return joins_as is not None and joins_as != JOINS_AS[role]

    def guarded_state() -> tuple:
        """What a refused call must not change: who is joined, and who holds which lease."""
        q = running.ledger._q
        return (
            [tuple(r) for r in q("SELECT id, role, state FROM workers ORDER BY id")],
            [tuple(r) for r in q("SELECT id, state, holder, attempts FROM chunks ORDER BY id")],
            [tuple(r) for r in q("SELECT id, holder FROM shards ORDER BY id")],
        )

    class ServiceFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.held: dict[str, list[int]] = {}  # shard leases per worker id
            self.refused_push_ids: list[str] = []

        # -- the call, and what a refusal is -----------------------------------------------

        def call(
            self, what: str, fn: Any, who: str = "", acting: str = "", joins_as: int | None = None
        ) -> Any:
            """Make one call (fn gets the caller's stub); None when it was refused."""
            tally.calls += 1
            tally.by_call[what] = tally.by_call.get(what, 0) + 1
            must_refuse = forbidden(what, who, acting, joins_as)
            before = guarded_state() if must_refuse else None
            try:
                reply = fn(stubs.get(who, plain))
            except grpc.RpcError as e:
                # A stranger's certificate fails the TLS handshake: the call never reaches a handler.
                known = REFUSALS | ({grpc.StatusCode.UNAVAILABLE} if who == "stranger" else set())
                assert e.code() in known, f"{what}: {e.code()} {e.details()}"  # a crash, not a refusal
                tally.refused += 1
                reply = None
            if must_refuse:
                tally.must_refuse += 1
                assert reply is None, f"{what} by {who} acting as {acting or who} was accepted: {reply}"
                assert guarded_state() == before, f"a refused {what} by {who} changed the ledger"
            elif reply is not None and what == "join":
                owner[acting or who] = host_of.get(who, "")
                live.add(acting or who)
            elif reply is not None and what == "leave":
                live.discard(acting or who)
            return reply

        # -- rules: `who` makes the call, acting as `acting` (its own worker id when "") ---------

        @rule(who=st.sampled_from(callers), acting=ACTING, as_role=st.sampled_from([0, *JOIN_ROLES]))
        def join(self, who: str, acting: str, as_role: int) -> None:
            role = as_role or IDENTITIES.get(who) or JOINS_AS.get(CERT_ROLES.get(who, ""), 0)
            request = pb.JoinRequest(role=role, host="fuzz", worker_id=acting or who)
            self.call("join", lambda s: s.Join(request, timeout=5), who, acting, joins_as=role)

        @rule(who=st.sampled_from(callers), acting=ACTING, value=st.sampled_from(COUNTERS),
              device=st.sampled_from(["cpu", "x" * 300, "bad\x00"]))  # fmt: skip
        def heartbeat(self, who: str, acting: str, value: float, device: str) -> None:
            request = pb.HeartbeatRequest(
                worker_id=acting or who, inner_steps=int(value) if math.isfinite(value) and 0 <= value < 2**63 else 0,
                busy_seconds=value, wall_seconds=value, last_loss=value, device=device,
                shard_leases=self.held.get(acting or who, []), train_metrics={"acc": value},
            )  # fmt: skip
            self.call("heartbeat", lambda s: s.Heartbeat(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def lease_shard(self, who: str, acting: str) -> None:
            request = pb.LeaseShardRequest(worker_id=acting or who)
            reply = self.call("lease_shard", lambda s: s.LeaseShard(request, timeout=5), who, acting)
            if reply is not None and reply.shard_id:
                self.held.setdefault(acting or who, []).append(reply.shard_id)

        @rule(who=st.sampled_from(callers), acting=ACTING, kind=st.sampled_from(PUSH_KINDS),
              rows=st.integers(0, 40))  # fmt: skip
        def push(self, who: str, acting: str, kind: str, rows: int) -> None:
            frag = service.fragments[0] if service.fragments else None
            version = frag.version if frag is not None else 0
            header = pb.TensorHeader(
                worker_id=acting or who, fragment=99 if kind == "unknown_fragment" else 0,
                version=max(0, version - 100) if kind == "stale" else version, codec="int8" if kind == "wrong_codec" else "fp32",
                inner_steps=1, tokens=(1 << 60) if kind == "huge_tokens" else 129 * max(1, rows),
                push_id=uuid.uuid4().hex, mean_loss=1.0,
            )  # fmt: skip
            held = self.held.get(acting or who, [])
            if held and kind != "no_rows":
                header.spans.add(shard_id=held[0], row_start=0, row_end=max(1, rows))
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
                "push", lambda s: s.PushDelta(stream_tensors(header, tensors, 1 << 20), timeout=10), who, acting
            )  # fmt: skip
            if reply is None or not reply.accepted:
                tally.refused_pushes += 1
                self.refused_push_ids.append(header.push_id)
            else:
                tally.accepted_pushes += 1

        @rule(who=st.sampled_from([c for c in callers if c.startswith("learner")]), rows=st.integers(1, 40))
        def honest_push(self, who: str, rows: int) -> None:
            """A learner's own join, lease and valid push, in one rule: the accepted path, taken
            often enough that merges happen among the malformed calls (a valid push drawn at
            random rarely finds its learner joined and holding a shard)."""
            self.join(who, "", 0)
            self.lease_shard(who, "")
            self.push(who, "", "valid", rows)

        @rule(who=st.sampled_from(callers), acting=ACTING, scale=st.sampled_from([0.0, 1.0, 1e30]))
        def init_parameters(self, who: str, acting: str, scale: float) -> None:
            """The model is set once, by the first learner: from anyone after that, nothing changes."""
            versions = [f.version for f in service.fragments]
            before = {n: t.clone() for f in service.fragments for n, t in f.params.items()}
            header = pb.TensorHeader(worker_id=acting or who)
            tensors = {n: t * scale for n, t in init.items()}
            self.call("init", lambda s: s.InitParameters(stream_tensors(header, tensors, 1 << 20), timeout=10),
                      who, acting)  # fmt: skip
            after = {n: t for f in service.fragments for n, t in f.params.items()}
            if [f.version for f in service.fragments] == versions:  # else a merge moved it meanwhile
                assert all(torch.equal(before[n], after[n]) for n in before), (
                    f"InitParameters by {who} changed the model"
                )

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def finish(self, who: str, acting: str) -> None:
            """Ending the run is the operator's alone (the operator's own Finish would end this one)."""
            if CERT_ROLES.get(who) == "operator" or not secure:
                return
            request = pb.FinishRequest(reason="fuzz")
            self.call("finish", lambda s: s.Finish(request, timeout=5), who, acting)
            assert service.run_state == "running", f"Finish by {who} ended the run"

        @rule(who=st.sampled_from(callers))
        def status(self, who: str) -> None:
            self.call("status", lambda s: s.Status(pb.StatusRequest(), timeout=10), who)

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def lease_chunk(self, who: str, acting: str) -> None:
            request = pb.LeaseChunkRequest(worker_id=acting or who)
            self.call("lease_chunk", lambda s: s.LeaseChunk(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING, have=st.integers(-1, 3))
        def pull(self, who: str, acting: str, have: int) -> None:
            request = pb.PullRequest(worker_id=acting or who, fragments=[0], have_versions=[have], wait_s=0.0)
            self.call("pull", lambda s: list(s.PullParameters(request, timeout=10)), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING, chunk=st.integers(0, 200),
              uri=st.sampled_from(["/etc/passwd", "../x", "", "s3://elsewhere/a"]),
              count=st.sampled_from([0, 1, 1 << 62]))  # fmt: skip
        def complete_chunk(self, who: str, acting: str, chunk: int, uri: str, count: int) -> None:
            request = pb.CompleteChunkRequest(worker_id=acting or who, chunk_id=chunk, completion_id=uuid.uuid4().hex,
                                              shard_uri=uri, rows=count, tokens=count, checksum="0" * 64)  # fmt: skip
            self.call("complete_chunk", lambda s: s.CompleteChunk(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING, chunk=st.integers(0, 200))
        def fail_chunk(self, who: str, acting: str, chunk: int) -> None:
            request = pb.FailChunkRequest(worker_id=acting or who, chunk_id=chunk, error="x" * 5000)
            self.call("fail_chunk", lambda s: s.FailChunk(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING, shard=st.integers(0, 50))
        def report_shard(self, who: str, acting: str, shard: int) -> None:
            request = pb.ReportShardRequest(worker_id=acting or who, shard_id=shard, error="fuzz")
            self.call("report_shard", lambda s: s.ReportShard(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def leave(self, who: str, acting: str) -> None:
            request = pb.LeaveRequest(worker_id=acting or who, reason="fuzz")
            if self.call("leave", lambda s: s.Leave(request, timeout=5), who, acting) is not None:
                self.held[acting or who] = []

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


def fuzz_certificates(tmp: Path) -> tuple[dict[str, Security], dict[str, Security]]:
    """Every caller's Security for `make_machine`'s channels (CERT_ROLES, and a stranger from
    another CA), and for `tiny_coordinator`: the coordinator's, its data worker's, its learner's."""
    init_ca(tmp / "ca")
    init_ca(tmp / "other-ca")
    mine = {name: Security(tls=issue(tmp / "ca", role, name)) for name, role in CERT_ROLES.items()}
    mine["stranger"] = Security(tls=issue(tmp / "other-ca", "learner", "stranger"))
    coordinator = Security(tls=issue(tmp / "ca", "coordinator", "coordinator"))
    return mine, {"coordinator": coordinator, "data": mine["data-a"], "learner": mine["learner-a"]}


def has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here: with 127.0.0.1, two hosts without leaving the machine."""
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


def plaintext_hosts() -> tuple[str, bool]:
    """Where a plaintext coordinator for the fuzzer listens, and whether `make_machine` gets two
    hosts: localhost (127.0.0.1 and ::1) where ::1 binds, else 127.0.0.1 alone."""
    two = has_ipv6_loopback()
    return ("localhost" if two else "127.0.0.1"), two


def fuzz_overrides() -> dict[str, object]:
    """The coordinator the fuzzer drives: a short staleness bound (stale pushes are refused
    early), data for many epochs (shards to lease for the whole run), leases and workers that
    outlive the whole run (nothing expires in the middle of a call that must change nothing)."""
    return {"sync.max_staleness": 4, "data.epochs": 50, "coordinator.lease_ttl_s": 3600.0}


def audit_ok(workdir: Path) -> list[str]:
    from diloco.coordinator.audit import audit

    return audit(workdir).violations
