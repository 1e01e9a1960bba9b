"""Who may join, and how often, against the red team's round-2 defects 7, 8 and 9
(walkR2/redteam/REPORT.md): a worker id once joined under another role was refused to its owner for
good, restarts included; one host joined and left 238 fresh ids a second, each a ledger row kept;
one learner's 580 heartbeats a second were each written to the ledger. The pure rules first, moved
by a fake clock, then each attack against a real coordinator in token mode."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.callers import (
    HEARTBEAT_BURST,
    NEW_ID_BURST,
    NEW_ID_EVERY_S,
    Binding,
    Callers,
    Rates,
    heartbeat_rate,
    join_refusal,
    spend,
)
from diloco.coordinator.ledger import Ledger
from diloco.coordinator.service import ticker as service_ticker
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb
from tests.support import FakeClock, start_coordinator_here
from tests.unit.coordinator.ledger_setup import TTL, push, with_train_shard

DENIED, RETRY = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED
TOKEN = Security(token="s3cret-token-for-the-test")


def refusal(role: str, caller: str, bound: Binding | None):
    r = join_refusal("learner-host-3", role, caller, bound, 0, 64)
    return None if r is None else r.code


# -- 7: an id's role is freed with its host binding ------------------------------------------------


def test_a_host_bound_id_that_left_or_lapsed_frees_its_role() -> None:
    squat = Binding("observer", "host:a", live=False)  # joined as an observer, then left
    assert refusal("compute", "host:a", squat) is None
    assert refusal("compute", "host:b", squat) is None
    # Still live: its own host is told at once, another host waits for its lease to lapse.
    assert refusal("compute", "host:a", Binding("observer", "host:a", live=True)) == DENIED
    assert refusal("compute", "host:b", Binding("observer", "host:a", live=True)) == RETRY
    # Under mutual TLS an id keeps its certificate, and the role it joined with, for the run.
    assert refusal("compute", "cert:observer:learner-host-3", None) == DENIED
    cert = Binding("observer", "cert:operator:learner-host-3", live=False)
    assert refusal("compute", "cert:learner:learner-host-3", cert) == DENIED


def coordinator(corpus: Path, workdir: Path, extra: dict[str, object] | None = None):
    """A token-mode coordinator on `corpus`, with `extra` config keys."""
    cfg = RunConfig().with_overrides(
        {"data.dataset": str(corpus), "data.chunk_bytes": 65536, **(extra or {})}
    )
    return start_coordinator_here(cfg, str(workdir), security=TOKEN)


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


@pytest.mark.timeout(120)
def test_an_id_squatted_under_another_role_goes_back_to_its_learner(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # The attack: a token holder joined learner-host-3 (the learner's --worker-id, its hostname) as
    # an observer and left; after a restart the learner's join was refused for the run.
    running = coordinator(tiny_corpus, tmp_path)
    squatter = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_OBSERVER, security=TOKEN)
    try:
        squat = pb.JoinRequest(role=pb.ROLE_OBSERVER, host="h", worker_id="learner-host-3")
        squatter.stub.Join(squat, timeout=5)
        live = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="learner-host-3")
        code, why = code_of(lambda: squatter.stub.Join(live, timeout=5))
        assert code == DENIED and "observer worker's" in why  # live: its role holds
        squatter.stub.Leave(pb.LeaveRequest(worker_id="learner-host-3"), timeout=5)
    finally:
        squatter.close()
        running.stop()
    running = coordinator(tiny_corpus, tmp_path)  # the same run, a new life
    learner = CoordinatorClient(
        f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, worker_id="learner-host-3", security=TOKEN
    )
    try:
        assert learner.join(timeout_s=10).worker_id == "learner-host-3"
        learner.heartbeat(pb.HeartbeatRequest(inner_steps=3))
        assert running.ledger.binding("learner-host-3")[0] == "compute"
        assert running.ledger.live_worker_stats("compute", 30)["learner-host-3"]["inner_steps"] == 3
    finally:
        learner.close()
        running.stop()


# -- 8: joins of new ids, per caller ---------------------------------------------------------------


def test_a_bucket_lets_a_burst_through_then_its_rate() -> None:
    bucket, t = None, 1000.0
    for _ in range(3):
        bucket, why = spend(bucket, t, per_s=0.5, burst=3)
        assert why == ""
    bucket, why = spend(bucket, t, per_s=0.5, burst=3)
    assert "more than 3 at once" in why
    bucket, why = spend(bucket, t + 1.0, per_s=0.5, burst=3)
    assert why  # half a call refilled
    bucket, why = spend(bucket, t + 2.0, per_s=0.5, burst=3)
    assert why == ""  # one refilled
    bucket, _ = spend(bucket, t + 1e6, per_s=0.5, burst=3)
    assert bucket.level == 2  # refilled to the burst, no more


def test_rates_stay_bounded_in_number() -> None:
    rates = Rates(per_s=1.0, burst=2)
    for i in range(Rates.MAX_KEYS + 10):
        assert rates.take(f"k{i}", 0.0) == ""
    assert len(rates._buckets) <= Rates.MAX_KEYS


def test_a_caller_joins_new_ids_at_a_rate_and_its_own_again_at_once(tmp_path: Path) -> None:
    clock = FakeClock()
    callers = Callers(Ledger(str(tmp_path / "ledger.sqlite"), clock=clock))

    def join(worker_id: str, caller: str = "host:a"):
        r = callers.join(worker_id, "compute", "h", caller, cap=64, ttl_s=30)
        if r is None:
            callers.ledger.leave(worker_id)  # join and leave: the live cap never binds
        return r

    assert all(join(f"w{i}") is None for i in range(NEW_ID_BURST))
    refused = join("fresh")
    assert refused.code == RETRY and "new worker ids" in refused.why
    assert callers.ledger.binding("fresh") is None  # refused: nothing written
    assert join("w0") is None  # an id it holds: a restarted worker joins again at once
    assert join("fresh", "host:b") is None  # another host has a rate of its own
    clock.advance(NEW_ID_EVERY_S)  # one more new id
    assert join("fresher") is None
    assert join("freshest").code == RETRY


@pytest.mark.timeout(120)
def test_join_and_leave_of_fresh_ids_does_not_grow_the_ledger_without_bound(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    running = coordinator(tiny_corpus, tmp_path)
    evil = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, security=TOKEN)
    try:
        joined, code, why = 0, None, ""
        for i in range(NEW_ID_BURST + 50):
            try:
                evil.stub.Join(pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id=f"x{i}"), timeout=5)
            except grpc.RpcError as e:
                code, why = e.code(), e.details()
                break
            evil.stub.Leave(pb.LeaveRequest(worker_id=f"x{i}"), timeout=5)
            joined += 1
        assert code == RETRY and "new worker ids" in why, (joined, code, why)
        assert NEW_ID_BURST <= joined <= NEW_ID_BURST + 5
        rows = running.ledger._q("SELECT COUNT(*) FROM workers")[0][0]
        refused = running.service.status_detail()["calls_refused"]
        code, _ = code_of(
            lambda: evil.stub.Join(pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="y"), timeout=5)
        )
        assert code == RETRY
        assert running.ledger._q("SELECT COUNT(*) FROM workers")[0][0] == rows  # refused: nothing kept
        assert running.service.status_detail()["calls_refused"] == refused + 1  # and counted
        # Its own id again (a restarted worker), at once.
        evil.stub.Join(pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="x0"), timeout=5)
    finally:
        evil.close()
        running.stop()


def test_ids_that_only_joined_are_forgotten_and_the_rest_kept(tmp_path: Path) -> None:
    # The rate bound slows fresh ids to thousands a day per host; those that only joined and went
    # are deleted an hour after, while every id the run's history names stays.
    clock = FakeClock()
    ledger = Ledger(str(tmp_path / "ledger.sqlite"), clock=clock)
    (sid,) = with_train_shard(ledger)  # data worker d1 leased and completed a chunk
    for worker in ("d1", "phantom", "lapsed", "pusher", "holder", "evaluator", "alive", "late"):
        ledger.join(worker, "compute", "h")
    ledger.leave("phantom")
    assert push(ledger, "p1", [(sid, 0, 2)], worker="pusher") is None
    ledger.leave("pusher")
    ledger.lease_shard("holder", TTL)
    ledger.leave("holder")
    ledger.record_eval("evaluator", [0], 0, 3.0, {}, 8, 0.1)
    ledger.leave("evaluator")
    ledger.leave("d1")
    clock.advance(TTL + 1)
    ledger.heartbeat("alive", {})
    ledger.heartbeat("late", {})
    ledger.reclaim_expired(TTL)  # "lapsed" went silent: lost
    assert ledger.forget_idle(3600) == 0  # gone, but not for an hour yet
    clock.advance(3600)
    ledger.heartbeat("alive", {})
    ledger.heartbeat("late", {})
    ledger.leave("late")  # gone a second ago
    clock.advance(1)
    assert ledger.forget_idle(3600, limit=1) == 1  # a bounded batch per pass
    assert ledger.forget_idle(3600) == 1
    left = {r["id"] for r in ledger.workers()}
    assert left == {"pusher", "holder", "evaluator", "alive", "late", "d1"}
    assert ledger.binding("phantom") is None  # its id is a fresh one again, its role free
    ledger.close()


@pytest.mark.timeout(120)
def test_the_coordinator_forgets_ids_that_only_joined(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_ticker, "FORGET_EVERY_S", 0.0)
    running = coordinator(tiny_corpus, tmp_path, {"coordinator.forget_workers_after_s": 0.1})
    evil = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, security=TOKEN)
    try:
        for i in range(20):
            evil.stub.Join(pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id=f"x{i}"), timeout=5)
            evil.stub.Leave(pb.LeaveRequest(worker_id=f"x{i}"), timeout=5)
        deadline = time.monotonic() + 30
        while running.ledger._q("SELECT COUNT(*) FROM workers WHERE id LIKE 'x%'")[0][0]:
            assert time.monotonic() < deadline, "ids that only joined were never forgotten"
            time.sleep(0.1)
    finally:
        evil.close()
        running.stop()


# -- 9: heartbeats, per worker ---------------------------------------------------------------------


def test_heartbeats_a_worker_may_send() -> None:
    assert heartbeat_rate(3.0) == 4.0  # at least 4 a second: a learner waiting for budget asks twice
    assert heartbeat_rate(0.1) == pytest.approx(40.0)  # several per heartbeat interval
    rates, t = Rates(heartbeat_rate(3.0), HEARTBEAT_BURST), 1000.0
    # An honest learner: every heartbeat_s, and twice a second while it waits for budget.
    for i in range(100):
        assert rates.take("l1", t + i * 0.45) == ""
    flood = [rates.take("l2", t + i * 0.001) for i in range(100)]
    assert flood.count("") <= HEARTBEAT_BURST + 1


@pytest.mark.timeout(120)
def test_a_heartbeat_flood_is_answered_without_the_ledger(tiny_corpus: Path, tmp_path: Path) -> None:
    running = coordinator(tiny_corpus, tmp_path)
    learner = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, worker_id="l1", security=TOKEN)
    try:
        learner.join(timeout_s=10)
        for i in range(1, 61):  # 60 heartbeats at once, each with made-up figures
            reply = learner.heartbeat(pb.HeartbeatRequest(inner_steps=i, tokens_trained=i))
            assert reply.coordinator_epoch == running.service.epoch  # answered all the same
        kept = running.ledger.live_worker_stats("compute", 30)["l1"]["inner_steps"]
        assert kept <= HEARTBEAT_BURST + 5, kept  # the rest never reached the ledger
    finally:
        learner.close()
        running.stop()
