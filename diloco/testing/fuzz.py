"""A Hypothesis state machine that drives a real coordinator over gRPC with random sequences of
valid and malformed calls from several identities (tests/unit/security/test_fuzz.py runs a few
hundred; benchmarks/fuzz.py runs ten thousand and more). Test tooling: it needs hypothesis (dev).

Calls act on the run's objects as they stand in the ledger: pushes name rows of the caller's own
shards, of shards leased to another worker or never leased, rows already in others' pushes or its
own, held-out, corrupt and out-of-range rows, no rows again and again, steps and tokens far beyond
their rows, deltas far above the fragment's parameter norm; shard reports for shards the caller
did not lease last; chunk completions of another data worker's attempt or another attempt's
file; joins under another id, with none, or in the wrong role; heartbeats, leaves and everything
else as another worker. Each call is judged before it is made: the policy (who may call what, as
whom) and the oracle (diloco.testing.fuzz_oracle: the call's own facts against the README's rules)
say whether it must be refused, or is a well-behaved worker's call that should be taken.

After every call: the coordinator answered with a result or a refusal, never an internal error;
a call that must be refused was, and changed no worker, lease, shard or push; the global
parameters are finite; no row is merged twice; no worker id is held by two callers (under mutual
TLS: a certificate holds its own name only); InitParameters (the run has parameters) changes
nothing. At the end of a run the ledger's audit passes. Calls go through the raw stubs (no client
retries), each with a short deadline.

With certificates (`channels`: one mutual-TLS channel per identity, from `diloco certs`), the
policy below is issue 14's, written out again here so the guard is checked against it.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import grpc
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from diloco.testing.fuzz_oracle import (
    Facts,
    Tally,
    Verdict,
    completion_verdict,
    report_verdict,
    taken,
    unchanged,
)
from diloco.testing.fuzz_policy import (
    ACTING,
    CERT_ROLES,
    COUNTERS,
    IDENTITIES,
    INIT_KINDS,
    JOIN_ROLES,
    JOINS_AS,
    OTHER_HOST,
    PUSH_KINDS,
    REFUSALS,
    ROWS,
    audit_ok,
    fuzz_certificates,
    fuzz_overrides,
    has_ipv6_loopback,
    holders_of,
    own_id,
    plaintext_hosts,
    policy_refusal,
)
from diloco.testing.fuzz_targets import (
    completion_target,
    init_tensors,
    joined_or_refused,
    push_request,
    report_target,
)
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pb_grpc
from diloco.wire.tensors import stream_tensors

# What callers import from here (the machine, its set-up, its tally).
__all__ = [
    "Tally", "audit_ok", "fuzz_certificates", "fuzz_overrides", "has_ipv6_loopback", "make_machine",
    "plaintext_hosts",
]  # fmt: skip


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
    `two_hosts` (plaintext, a coordinator listening on localhost), the OTHER_HOST identities call
    from ::1 and the others from 127.0.0.1: a worker id belongs to the host that joined it."""
    secure = channels is not None
    channels = channels or {}
    plain = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    stubs = {who: pb_grpc.CoordinatorStub(c) for who, c in channels.items()}
    host_of = {who: "::1" if who in OTHER_HOST and two_hosts else "127.0.0.1" for who in IDENTITIES}
    if two_hosts and not secure:
        other = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"[::1]:{running.port}"))
        stubs.update({who: other for who in OTHER_HOST})
    stub = stubs.get("watcher", plain)  # the invariants' own calls: an observer's
    callers = sorted(channels) if secure else sorted(IDENTITIES)
    service = running.service
    facts = Facts(running.ledger._q)
    h, batch = service.config.train.inner_steps, service.config.train.batch_size
    chunk_leases: dict[tuple[int, str], str] = {}  # (chunk, the file its lease named) -> who leased it
    # Who holds each worker id: the caller (an identity under mutual TLS, else a host) whose join
    # was taken. Seeded with the workers joined before the fuzzer (the run's own learner).
    holder = holders_of(facts.q("SELECT id, caller FROM workers WHERE caller IS NOT NULL"))

    def me(who: str) -> str:
        return who if secure else host_of.get(who, "")

    def forbidden(what: str, who: str, acting: str, joins_as: int | None = None, blank: bool = False) -> str:
        return policy_refusal(
            what, who, acting, joins_as, blank, secure=secure, holder=holder, me=me(who), live=facts.live
        )

    class ServiceFuzz(RuleBasedStateMachine):
        # -- the call, and what a refusal is -----------------------------------------------

        def call(
            self,
            what: str,
            fn: Any,
            who: str = "",
            acting: str = "",
            joins_as: int | None = None,
            verdict: tuple[Verdict, str] = (Verdict.EITHER, ""),
            blank: bool = False,
        ) -> Any:
            """Make one call (fn gets the caller's stub); the reply, None when refused with an
            error. Counted by what the policy and the oracle said of it."""
            tally.calls += 1
            tally.count(tally.by_call, what)
            policy = forbidden(what, who, acting, joins_as, blank)
            why = policy or (verdict[1] if verdict[0] is Verdict.REFUSE else "")
            honest = not policy and verdict[0] is Verdict.HONEST
            before = facts.guarded_state() if why else None
            details = ""
            try:
                reply = fn(stubs.get(who, plain))
            except grpc.RpcError as e:
                # A stranger's certificate fails the TLS handshake: the call never reaches a handler.
                known = REFUSALS | ({grpc.StatusCode.UNAVAILABLE} if who == "stranger" else set())
                assert e.code() in known, f"{what}: {e.code()} {e.details()}"  # a crash, not a refusal
                tally.refused += 1
                reply, details = None, f"{e.code().name} {e.details()}"
            ok = taken(what, reply)
            if why:
                tally.must_refuse += 1
                tally.count(tally.must_refuse_by_reason, f"{what}: {why}")
                if ok:
                    tally.must_refuse_accepted += 1
                    tally.defects.append(f"{what} by {who} as {acting or own_id(who)} ({why}) taken: {reply}")
                else:
                    tally.must_refuse_refused += 1
                assert not ok, f"{what} by {who} as {acting or own_id(who)} must be refused ({why}): {reply}"
                assert unchanged(before, facts.guarded_state()), (
                    f"a refused {what} by {who} changed the ledger"
                )
            elif honest:
                tally.honest += 1
                if not ok:
                    tally.honest_refused += 1
                    said = details or getattr(reply, "reason", "")
                    tally.count(tally.honest_refused_by_reason, f"{what} ({verdict[1]}): {said[:90]}")
            if ok and what not in ("leave", "status", "finish"):  # (a leave frees; checked as forbidden)
                worker = (
                    (reply.worker_id if what == "join" and reply.worker_id else "") or acting or own_id(who)
                )
                was = holder.get(worker)
                assert was in (None, me(who)) or (what == "join" and not secure), (
                    f"{what} by {who} taken as {worker}, which {was} holds"
                )
                holder[worker] = me(who)
            return reply

        def worker(self, who: str, acting: str) -> str:
            return acting or own_id(who)

        # -- rules: `who` makes the call, acting as `acting` (its own worker id when "") ---------

        @rule(who=st.sampled_from(callers), acting=ACTING, as_role=st.sampled_from([0, *JOIN_ROLES]),
              named=st.sampled_from(["own", "own", "blank", "fresh"]))  # fmt: skip
        def join(self, who: str, acting: str, as_role: int, named: str = "own") -> None:
            """A join as itself, as another, without an id (under mutual TLS: its certificate's
            name), or under a fresh id (under mutual TLS a phantom: refused)."""
            role = as_role or IDENTITIES.get(who) or JOINS_AS.get(CERT_ROLES.get(who, ""), 0)
            worker = {"own": acting or own_id(who), "blank": "", "fresh": f"phantom-{uuid.uuid4().hex[:8]}"}[
                named
            ]
            request = pb.JoinRequest(role=role, host="fuzz", worker_id=worker)
            verdict = (Verdict.REFUSE, "a phantom: an id not its certificate's") if secure and named == "fresh" else (
                (Verdict.HONEST, "its own id, in its role") if named == "own" and not acting and not as_role else (Verdict.EITHER, "")
            )  # fmt: skip
            reply = self.call(
                "join",
                lambda s: s.Join(request, timeout=5),
                who,
                acting if named == "own" else worker,
                role,
                verdict,
                not worker,
            )
            if reply is not None and secure:
                assert reply.worker_id == own_id(who), (
                    f"{who} joined as {reply.worker_id}: not its certificate's name"
                )
            elif reply is not None and named != "own":  # plaintext: a host's workers are capped; let it go
                leave = pb.LeaveRequest(worker_id=reply.worker_id, reason="fuzz")
                self.call("leave", lambda s: s.Leave(leave, timeout=5), who, reply.worker_id)

        @rule(who=st.sampled_from(callers), acting=ACTING, value=st.sampled_from(COUNTERS),
              device=st.sampled_from(["cpu", "x" * 300, "bad\x00"]))  # fmt: skip
        def heartbeat(self, who: str, acting: str, value: float, device: str) -> None:
            worker = self.worker(who, acting)
            leases = [s["id"] for s in facts.shards() if s["holder"] == worker]
            request = pb.HeartbeatRequest(
                worker_id=worker, inner_steps=int(value) if math.isfinite(value) and 0 <= value < 2**63 else 0,
                busy_seconds=value, wall_seconds=value, last_loss=value, device=device,
                shard_leases=leases, train_metrics={"acc": value},
            )  # fmt: skip
            verdict = joined_or_refused(facts, worker)
            self.call("heartbeat", lambda s: s.Heartbeat(request, timeout=5), who, acting, verdict=verdict)

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def lease_shard(self, who: str, acting: str) -> None:
            worker = self.worker(who, acting)
            request = pb.LeaseShardRequest(worker_id=worker)
            verdict = joined_or_refused(facts, worker)
            self.call("lease_shard", lambda s: s.LeaseShard(request, timeout=5), who, acting, verdict=verdict)

        @rule(who=st.sampled_from(callers), acting=ACTING, kind=st.sampled_from(PUSH_KINDS),
              rows=st.sampled_from(ROWS), pick=st.integers(0, 7), width=st.integers(1, 40))  # fmt: skip
        def push(self, who: str, acting: str, kind: str, rows: str, pick: int = 0, width: int = 10) -> None:
            worker = self.worker(who, acting)
            header, tensors, verdict = push_request(facts, service, init, worker, kind, rows, pick, width)
            reply = self.call(
                "push", lambda s: s.PushDelta(stream_tensors(header, tensors, 1 << 20), timeout=10), who, acting,
                verdict=verdict,
            )  # fmt: skip
            if reply is None or not reply.accepted:
                tally.refused_pushes += 1
                self.refused_push_ids.append(header.push_id)
                return
            tally.accepted_pushes += 1
            # Credited no more than the rows behind it: every train shard its worker ever leased.
            state = running.ledger.push_state(header.push_id)
            rows_ever, tokens_ever = facts.ever_leased_tokens(worker)
            credit = (state["steps"], state["tokens"]) if state is not None else (0, 0)
            if credit[0] > max(h, math.ceil(rows_ever / batch)) or credit[1] > tokens_ever:
                tally.defects.append(f"push {header.push_id} by {worker} credited {credit} beyond its rows")
                raise AssertionError(tally.defects[-1])

        @rule(who=st.sampled_from([c for c in callers if c.startswith("learner")]), width=st.integers(1, 40))
        def honest_push(self, who: str, width: int) -> None:
            """A learner's own join, lease and valid push of fresh rows, in one rule: the accepted
            path, taken often enough that merges happen among the malformed calls."""
            self.join(who, "", 0)
            self.lease_shard(who, "")
            self.push(who, "", "valid", "own", 0, width)

        def __init__(self) -> None:
            super().__init__()
            self.refused_push_ids: list[str] = []

        @rule(who=st.sampled_from(callers), acting=ACTING, kind=st.sampled_from(INIT_KINDS))
        def init_parameters(self, who: str, acting: str, kind: str) -> None:
            """The model is set once, by the first learner: from anyone after that, whatever it
            holds (the run's model, every tensor marked averaged, an unsplittable one, another
            model, huge values), it is refused and nothing changes."""
            versions = [f.version for f in service.fragments]
            before = {n: t.clone() for f in service.fragments for n, t in f.params.items()}
            tensors, averaged = init_tensors(kind, init)
            header = pb.TensorHeader(worker_id=self.worker(who, acting))
            verdict = (Verdict.REFUSE, "the run has parameters already")
            self.call("init", lambda s: s.InitParameters(stream_tensors(header, tensors, 1 << 20, averaged), timeout=10),
                      who, acting, verdict=verdict)  # fmt: skip
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
            worker = self.worker(who, acting)
            request = pb.LeaseChunkRequest(worker_id=worker)
            verdict = joined_or_refused(facts, worker)
            reply = self.call(
                "lease_chunk", lambda s: s.LeaseChunk(request, timeout=5), who, acting, verdict=verdict
            )
            if reply is not None and reply.shard_uri:
                chunk_leases[reply.chunk_id, reply.shard_uri] = worker

        @rule(who=st.sampled_from(callers), acting=ACTING, have=st.integers(-1, 3))
        def pull(self, who: str, acting: str, have: int) -> None:
            worker = self.worker(who, acting)
            request = pb.PullRequest(worker_id=worker, fragments=[0], have_versions=[have], wait_s=0.0)
            verdict = joined_or_refused(facts, worker)
            self.call(
                "pull", lambda s: list(s.PullParameters(request, timeout=10)), who, acting, verdict=verdict
            )

        @rule(who=st.sampled_from(callers), acting=ACTING, aim=st.sampled_from(
              ["own", "own", "others", "other_attempt", "made", "/etc/passwd", "../x", "", "s3://elsewhere/a"]),
              pick=st.integers(0, 7), count=st.sampled_from([0, 1, 1 << 62]))  # fmt: skip
        def complete_chunk(self, who: str, acting: str, aim: str, pick: int, count: int) -> None:
            """A completion of the caller's own chunk attempt, another data worker's, another
            attempt's file of its own chunk, a shard file made already, or a path outside the store."""
            worker = self.worker(who, acting)
            chunk, uri = completion_target(facts, chunk_leases, worker, aim, pick)
            verdict = completion_verdict(chunk_leases, worker, chunk, uri) if facts.live(worker) else (
                Verdict.REFUSE, "a worker not joined")  # fmt: skip
            request = pb.CompleteChunkRequest(worker_id=worker, chunk_id=chunk, completion_id=uuid.uuid4().hex,
                                              shard_uri=uri, rows=count, tokens=count, checksum="0" * 64)  # fmt: skip
            self.call(
                "complete_chunk", lambda s: s.CompleteChunk(request, timeout=5), who, acting, verdict=verdict
            )

        @rule(who=st.sampled_from(callers), acting=ACTING, chunk=st.integers(0, 200))
        def fail_chunk(self, who: str, acting: str, chunk: int) -> None:
            request = pb.FailChunkRequest(
                worker_id=self.worker(who, acting), chunk_id=chunk, error="x" * 5000
            )
            self.call("fail_chunk", lambda s: s.FailChunk(request, timeout=5), who, acting)

        @rule(who=st.sampled_from(callers), acting=ACTING, pick=st.integers(0, 7), aim=st.sampled_from(
              ["own_held", "own_last", "own_last", "others", "never", "heldout", "missing"]))  # fmt: skip
        def report_shard(self, who: str, acting: str, pick: int, aim: str) -> None:
            """A corruption report of a shard the caller holds or held last, another's, one it
            never leased, a held-out shard, or no shard at all."""
            worker = self.worker(who, acting)
            shard = report_target(facts, worker, aim, pick)
            verdict = report_verdict(facts, worker, shard) if facts.live(worker) else (
                Verdict.REFUSE, "a worker not joined")  # fmt: skip
            request = pb.ReportShardRequest(worker_id=worker, shard_id=shard, error="fuzz\nFAKE LOG LINE")
            self.call(
                "report_shard", lambda s: s.ReportShard(request, timeout=5), who, acting, verdict=verdict
            )

        @rule(who=st.sampled_from(callers), acting=ACTING)
        def leave(self, who: str, acting: str) -> None:
            request = pb.LeaveRequest(worker_id=self.worker(who, acting), reason="fuzz")
            self.call("leave", lambda s: s.Leave(request, timeout=5), who, acting)

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

        @invariant()
        def every_row_merges_at_most_once(self) -> None:
            twice = facts.rows_merged_twice()
            assert not twice, f"rows merged twice: {twice}"

        @invariant()
        def a_certificate_holds_its_own_name_only(self) -> None:
            for worker, caller in facts.q("SELECT id, caller FROM workers WHERE caller LIKE 'cert:%'"):
                assert str(caller).endswith(f":{worker}"), f"{caller} holds worker {worker!r}: a phantom"

    return ServiceFuzz
