"""Callers told apart (their certificate's name, else their host): no one acts as another host's
worker, registers fake learners without bound, holds every push slot, or fills the handler pool
with long-polls; Status stays within its message limit whatever joined. The pure rules first,
then each attack of issue 14 against a real coordinator."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.coordinator.callers import Binding, Callers, RefusalLog, acting_problem, join_refusal, peer_host
from diloco.testing.fuzz import has_ipv6_loopback
from diloco.v1 import coordinator_pb2 as pb
from tests.support import stalled_push, tiny_coordinator


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:10.0.0.2:5000") == "10.0.0.2"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_a_worker_id_belongs_to_the_caller_that_joined_it() -> None:
    # (the rules with the ledger, restarts and certificates: tests/unit/security/test_identity_attacks.py)
    def join(w: str, caller: str, bound: Binding | None, mine: int = 0, cap: int = 2) -> str:
        refusal = join_refusal(w, "compute", caller, bound, mine, cap)
        return "" if refusal is None else refusal.why

    assert join("w", "host:a", None) == ""
    held = Binding("compute", "host:a", live=True)
    assert acting_problem("w", "host:a", held) == ""
    assert "another caller" in acting_problem("w", "host:b", held)
    # Another caller may not take the id while it is live; once its lease lapsed, it may.
    assert "live under another caller" in join("w", "host:b", held)
    assert join("w", "host:b", Binding("compute", "host:a", live=False)) == ""


def test_a_caller_registers_at_most_its_cap_of_live_workers() -> None:
    def join(w: str, caller: str, mine: int, cap: int = 2) -> str:
        refusal = join_refusal(w, "compute", caller, None, mine, cap)
        return "" if refusal is None else refusal.why

    assert join("b", "host:x", mine=1) == ""
    assert "max_workers_per_caller = 2" in join("c", "host:x", mine=2)
    assert join("e", "host:x", mine=2, cap=0) == ""  # 0: no cap


def test_a_flood_of_refusals_is_logged_once_a_minute_per_kind() -> None:
    refusals = RefusalLog(window_s=60.0)
    assert refusals.note("Status: a wrong token", 0.0) == (True, 0)
    assert all(refusals.note("Status: a wrong token", t / 10) == (False, 0) for t in range(1, 500))
    assert refusals.note("Join: no token", 1.0) == (True, 0)  # another kind: its own window
    assert refusals.note("Status: a wrong token", 60.0) == (True, 499)  # and how many were quiet
    assert refusals.note("Status: a wrong token", 61.0) == (False, 0)


def test_open_calls_are_capped_per_caller_and_in_all() -> None:
    callers = Callers(ledger=None)  # type: ignore[arg-type]  # (open calls are counted in memory)
    assert callers.open("pull", "a", cap=2, total_cap=3) == ""
    assert callers.open("pull", "a", cap=2, total_cap=3) == ""
    assert "a has 2 pull calls open" in callers.open("pull", "a", cap=2, total_cap=3)
    assert callers.open("pull", "b", cap=2, total_cap=3) == ""
    assert "3 pull calls open" in callers.open("pull", "c", cap=2, total_cap=3)
    assert callers.open("push", "c", cap=2, total_cap=3) == ""  # kinds counted apart
    callers.close("pull", "a")
    assert callers.open("pull", "c", cap=2, total_cap=3) == ""


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not has_ipv6_loopback(), reason="two loopback hosts need ::1 beside 127.0.0.1")
def test_one_host_cannot_act_as_another_hosts_worker(tiny_corpus: Path, tmp_path: Path) -> None:
    # The coordinator listens on 127.0.0.1 and ::1: two hosts, without leaving the machine. A
    # plaintext run tells callers apart by host, as the token mode does.
    with tiny_coordinator(tiny_corpus, tmp_path, {}, host="localhost") as (running, learner, _):
        other = CoordinatorClient(f"[::1]:{running.port}", pb.ROLE_COMPUTE, worker_id="learner-six")
        try:
            other.join()
            victim = learner.worker_id
            calls = {
                "Heartbeat": lambda: other.stub.Heartbeat(pb.HeartbeatRequest(worker_id=victim), timeout=5),
                "Leave": lambda: other.stub.Leave(pb.LeaveRequest(worker_id=victim), timeout=5),
                "LeaseShard": lambda: other.stub.LeaseShard(
                    pb.LeaseShardRequest(worker_id=victim), timeout=5
                ),
                "PullParameters": lambda: list(
                    other.stub.PullParameters(pb.PullRequest(worker_id=victim), timeout=5)
                ),
            }
            before = running.service.status_detail()["calls_refused"]
            for name, call in calls.items():
                code, why = code_of(call)
                assert code == grpc.StatusCode.PERMISSION_DENIED and "another caller" in why, (name, why)
            assert running.service.status_detail()["calls_refused"] == before + len(calls)
            join_as_victim = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id=victim)
            code, why = code_of(lambda: other.stub.Join(join_as_victim, timeout=5))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "live under another caller" in why
            # The victim is untouched: still live, and its own calls work.
            assert victim in running.ledger.live_workers("compute", 30)
            learner.heartbeat(pb.HeartbeatRequest())
            assert learner.pull([0])
        finally:
            other.close()


@pytest.mark.timeout(120)
def test_fake_learners_from_one_caller_are_capped(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"coordinator.max_workers_per_caller": 3}) as (
        running,
        learner,
        _,
    ):
        # The data worker that made the shards has left; the learner is one of three.
        address = f"127.0.0.1:{running.port}"
        fakes = [CoordinatorClient(address, pb.ROLE_COMPUTE, worker_id=f"fake-{i}") for i in (1, 2)]
        try:
            for fake in fakes:
                assert fake.join()
            request = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="fake-3")
            code, why = code_of(lambda: learner.stub.Join(request, timeout=5))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_workers_per_caller = 3" in why
            assert "fake-3" not in running.ledger.live_workers("compute", 30)
            learner.join()  # one of them joining again is no new worker
        finally:
            for fake in fakes:
                fake.close()


@pytest.mark.timeout(120)
def test_long_polls_need_a_joined_worker_and_cannot_fill_the_handler_pool(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # The attack: 70 long-poll pulls without joining held every handler thread, and honest joins
    # timed out. Now a pull needs a joined worker, and a caller waits in at most 16 at once.
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, learner, _):
        stranger = pb.PullRequest(worker_id="never-joined", fragments=[0], wait_s=20)
        code, _ = code_of(lambda: list(learner.stub.PullParameters(stranger, timeout=5)))
        assert code == grpc.StatusCode.NOT_FOUND
        version = running.service.fragments[0].published_version
        wait = pb.PullRequest(worker_id=learner.worker_id, fragments=[0], have_versions=[version], wait_s=20)
        outcomes: list[grpc.StatusCode | None] = []

        def long_poll() -> None:
            try:
                list(learner.stub.PullParameters(wait, timeout=30))
                outcomes.append(None)
            except grpc.RpcError as e:
                outcomes.append(e.code())

        threads = [threading.Thread(target=long_poll) for _ in range(70)]
        for t in threads:
            t.start()
        try:
            cap = running.service.config.coordinator.max_waiting_pulls_per_caller
            deadline = time.monotonic() + 20
            while outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 70 - cap:
                assert time.monotonic() < deadline, outcomes
                time.sleep(0.05)
            started = time.monotonic()
            honest = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, worker_id="honest")
            try:
                assert honest.join(timeout_s=5)
                assert time.monotonic() - started < 5
            finally:
                honest.close()
        finally:
            running.service.stop()  # wakes the waiting pulls: they answer with nothing new
            for t in threads:
                t.join(30)
        assert outcomes.count(None) == cap and len(outcomes) == 70, outcomes


@pytest.mark.timeout(120)
def test_one_caller_cannot_hold_every_push_slot(tiny_corpus: Path, tmp_path: Path) -> None:
    overrides = {"coordinator.max_pushes_per_caller": 2, "coordinator.max_inflight_pushes": 4}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        release = threading.Event()
        header_then_nothing = stalled_push(learner, init, release)

        def stalled() -> None:
            with contextlib.suppress(grpc.RpcError):
                learner.stub.PushDelta(header_then_nothing(), timeout=30)

        threads = [threading.Thread(target=stalled) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 10
            while running.service._push_slots._value > 2:  # both stalled pushes hold a slot
                assert time.monotonic() < deadline
                time.sleep(0.05)
            started = time.monotonic()
            code, why = code_of(lambda: learner.stub.PushDelta(header_then_nothing(), timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 push calls open" in why
            assert time.monotonic() - started < 2  # refused at once, holding no slot nor thread
        finally:
            release.set()
            for t in threads:
                t.join(10)


@pytest.mark.timeout(120)
def test_status_stays_within_its_message_limit_whatever_joined(tiny_corpus: Path, tmp_path: Path) -> None:
    # A small message limit stands for a long run's many workers: 120 workers with long ids and
    # 32 long metric names each would make a Status of ~450 KB.
    overrides = {
        "coordinator.max_message_bytes": 256 << 10,
        "coordinator.stream_chunk_bytes": 64 << 10,
        "coordinator.max_workers_per_caller": 0,
    }
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, _):
        metrics = {f"{i:02d}".ljust(64, "m"): 1.0 for i in range(32)}
        for i in range(120):
            worker = f"w{i:03d}".ljust(256, "x")
            running.ledger.join(worker, "compute", "h" * 256)
            running.ledger.heartbeat(worker, {"train_metrics": metrics, "device": "d" * 256})
        status = learner.status()
        assert status["workers_total"] == 122  # the learner, the data worker that left, 120 more
        shown = status["workers"]
        assert 0 < len(shown) < 122
        reply = learner.stub.Status(pb.StatusRequest(), timeout=10)
        assert reply.ByteSize() <= (256 << 10) // 2
        assert all(w["alive"] for w in shown)  # the live ones first: the data worker has left


@pytest.mark.timeout(120)
def test_a_worker_holds_at_most_its_cap_of_leases(tiny_corpus: Path, tmp_path: Path) -> None:
    overrides = {"coordinator.max_leases_per_worker": 1, "data.chunk_bytes": 4096}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, _):
        first = learner.lease_shard()
        assert first.uri and running.ledger.leases_held(learner.worker_id) == 1
        ready = running.ledger._one("SELECT COUNT(*) FROM shards WHERE split = 'train' AND state = 'ready'")
        assert ready >= 1  # there is another to take: only the cap stops it
        second = learner.lease_shard()
        assert not second.uri and second.retry_after_s > 0 and not second.done
        assert running.ledger.leases_held(learner.worker_id) == 1


@pytest.mark.timeout(120)
def test_a_certificate_of_another_role_named_like_a_live_worker_cannot_act_as_it(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Under mutual TLS a caller was its certificate's name alone: an observer's certificate named
    "learner-1" sent heartbeats of made-up figures for the live learner-1, and its Leave took the
    learner's leases. The caller is its role and name now."""
    from diloco.security.certs import init_ca, issue
    from diloco.security.transport import Security

    ca = tmp_path / "pki"
    init_ca(ca)
    security = {
        "coordinator": Security(tls=issue(ca, "coordinator", "coordinator")),
        "data": Security(tls=issue(ca, "data", "data-0")),
        "learner": Security(tls=issue(ca, "learner", "learner-1")),
    }
    namesake = Security(tls=issue(ca, "observer", "learner-1", out=tmp_path / "observer"))
    with tiny_coordinator(tiny_corpus, tmp_path / "run", {}, security) as (running, learner, _):
        assert learner.worker_id == "learner-1"
        other = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_OBSERVER, security=namesake)
        try:
            victim = pb.HeartbeatRequest(worker_id="learner-1", inner_steps=999_999)
            for name, call in {
                "Heartbeat": lambda: other.stub.Heartbeat(victim, timeout=5),
                "Leave": lambda: other.stub.Leave(pb.LeaveRequest(worker_id="learner-1"), timeout=5),
            }.items():
                code, why = code_of(call)
                assert code == grpc.StatusCode.PERMISSION_DENIED and "another caller" in why, (name, why)
            join = pb.JoinRequest(role=pb.ROLE_OBSERVER, host="h", worker_id="learner-1")
            code, why = code_of(lambda: other.stub.Join(join, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "a compute worker's" in why  # not even later
            assert "learner-1" in running.ledger.live_workers("compute", 30)
            learner.heartbeat(pb.HeartbeatRequest())  # its own calls still work
        finally:
            other.close()
