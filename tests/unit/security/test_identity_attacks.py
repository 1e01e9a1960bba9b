"""Who may be which worker (coordinator/callers.py), against the red team's attacks 6 and 7
(walkR/redteam/REPORT.md): one learner certificate registered 64 phantom learners by joining without
a worker id, and after a coordinator restart any certificate named like a worker (an observer's, say)
took its id by calling first. The pure rules first, then the ledger's bindings across a restart
and a ledger from before they were kept, then each attack against a real coordinator."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.callers import Binding, Callers, acting_problem, join_refusal, own_worker_id
from diloco.coordinator.ledger import Ledger
from diloco.security.certs import init_ca, issue
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb
from tests.support import FakeClock, start_coordinator_here

LEARNER, OBSERVER, OPERATOR = "cert:learner:l1", "cert:observer:l1", "cert:operator:l1"
DENIED, RETRY = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED


def refusal(worker_id: str, role: str, caller: str, bound: Binding | None, mine: int = 0, cap: int = 64):
    r = join_refusal(worker_id, role, caller, bound, mine, cap)
    return None if r is None else r.code


# -- the rules ---------------------------------------------------------------------------------


def test_under_mutual_tls_a_certificate_is_one_worker_its_name() -> None:
    assert own_worker_id("cert:learner:l1") == "l1"
    assert own_worker_id("cert:learner:a:b") == "a:b"  # a name may hold a colon; a role does not
    assert own_worker_id("host:10.0.0.2") == ""  # told apart by host: ids of its choosing, up to its cap


def test_a_worker_id_bound_to_a_certificate_is_its_for_the_run() -> None:
    learner = Binding("compute", LEARNER, live=False)
    assert refusal("l1", "compute", LEARNER, learner) is None  # a restarted learner, even if still "live"
    assert refusal("l1", "compute", LEARNER, Binding("compute", LEARNER, live=True)) is None
    # An observer's certificate named like a learner: refused, live or not, joined as a learner or not.
    assert refusal("l1", "compute", OBSERVER, None) == DENIED
    assert refusal("l1", "observer", OBSERVER, learner) == DENIED  # an id keeps its role
    # An observer worker fits an operator's and an observer's certificate: the first keeps it.
    supervisor = Binding("observer", OPERATOR, live=False)
    assert refusal("l1", "observer", OBSERVER, supervisor) == DENIED
    assert refusal("l1", "observer", OPERATOR, supervisor) is None


def test_a_worker_id_bound_to_a_host_moves_once_its_lease_lapsed() -> None:
    assert refusal("w", "compute", "host:b", Binding("compute", "host:a", live=True)) == RETRY
    assert refusal("w", "compute", "host:b", Binding("compute", "host:a", live=False)) is None
    assert refusal("w", "data", "host:a", Binding("compute", "host:a", live=True)) == DENIED
    assert refusal("w", "data", "host:a", Binding("compute", "host:a", live=False)) is None  # (round 2, #7)
    # A run resumed under mutual TLS: its certificates take the ids its hosts held, once lapsed.
    assert refusal("l1", "compute", LEARNER, Binding("compute", "host:a", live=True)) == RETRY
    assert refusal("l1", "compute", LEARNER, Binding("compute", "host:a", live=False)) is None
    # The per-caller cap: a host's other live workers (a certificate has none: its one id is its name).
    assert refusal("w9", "compute", "host:a", None, mine=64) == RETRY
    assert refusal("w9", "compute", "host:a", None, mine=64, cap=0) is None


def test_a_certificate_acts_only_as_a_worker_its_role_fits() -> None:
    assert acting_problem("l1", LEARNER, Binding("compute", LEARNER, live=True)) == ""
    assert "another caller" in acting_problem("l1", OBSERVER, Binding("compute", LEARNER, live=True))
    # Unbound (a ledger from before bindings were kept): anyone's whose role fits, no one else's.
    unbound = Binding("compute", "", live=True)
    assert acting_problem("l1", LEARNER, unbound) == ""
    assert "an observer certificate may not hold the compute worker" in acting_problem(
        "l1", OBSERVER, unbound
    )
    assert acting_problem("w", "host:a", unbound) == ""


# -- the ledger's bindings ---------------------------------------------------------------------


def test_bindings_outlive_a_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    path = str(tmp_path / "ledger.sqlite")
    ledger = Ledger(path, clock=clock)
    assert Callers(ledger).join("l1", "compute", "h", LEARNER, cap=64, ttl_s=30) is None
    assert Callers(ledger).join("w", "compute", "h", "host:a", cap=64, ttl_s=30) is None
    ledger.close()
    callers = Callers(Ledger(path, clock=clock))  # a restarted coordinator's
    assert "another caller" in callers.acting_problem("l1", OBSERVER)
    assert "another caller" in callers.acting_problem("w", "host:b")
    assert callers.acting_problem("l1", LEARNER) == callers.acting_problem("w", "host:a") == ""
    assert callers.join("w", "compute", "h", "host:b", cap=64, ttl_s=30).code == RETRY
    clock.advance(31)  # w's lease lapsed: its id may move to another host, l1's never
    assert callers.join("w", "compute", "h", "host:b", cap=64, ttl_s=30) is None
    assert callers.join("l1", "observer", "h", OBSERVER, cap=64, ttl_s=30).code == DENIED


def test_a_ledger_from_before_bindings_binds_each_id_to_its_first_fitting_caller(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as db:  # the workers table as it was
        db.execute(
            "CREATE TABLE workers (id TEXT PRIMARY KEY, role TEXT NOT NULL, host TEXT NOT NULL, "
            "joined REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL, stats TEXT NOT NULL DEFAULT '{}')"
        )
        db.execute("INSERT INTO workers VALUES ('l1', 'compute', 'h', 1000, 1000, 'active', '{}')")
    callers = Callers(Ledger(str(path), clock=FakeClock()))
    assert "an observer certificate may not hold" in callers.acting_problem("l1", OBSERVER)
    assert callers.acting_problem("l1", LEARNER) == ""  # bound now, to the learner's certificate
    assert "another caller" in callers.acting_problem("l1", "cert:learner:other")
    assert callers.ledger.binding("l1") == ("compute", LEARNER, False)


# -- against a real coordinator ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Security]:
    ca = tmp_path_factory.mktemp("pki")
    init_ca(ca)
    roles = {"coordinator": "coordinator", "l1": "learner", "obs": "observer"}
    made = {name: Security(tls=issue(ca, role, name)) for name, role in roles.items()}
    # The same CA's observer certificate, named like the learner (issued into another directory).
    namesake = issue(ca, "observer", "l1", out=tmp_path_factory.mktemp("namesake"))
    return {**made, "namesake": Security(tls=namesake)}


def coordinator(corpus: Path, workdir: Path, security: Security):
    cfg = RunConfig().with_overrides({"data.dataset": str(corpus), "data.chunk_bytes": 65536})
    return start_coordinator_here(cfg, str(workdir), security=security)


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def workers(running) -> list[tuple]:
    return [tuple(r) for r in running.ledger._q("SELECT id, role, state, caller FROM workers ORDER BY id")]


@pytest.mark.timeout(120)
def test_a_learner_certificate_cannot_register_phantom_learners(
    tiny_corpus: Path, tmp_path: Path, pki: dict[str, Security]
) -> None:
    # The attack: Join with an empty worker id, 63 times, gave 63 fresh compute-xxxx ids bound to
    # one learner's certificate; an honest merge then counted for 1/64 of a round (quorum 1), and
    # a synchronous round waited for the phantoms for ever.
    running = coordinator(tiny_corpus, tmp_path, pki["coordinator"])
    address = f"127.0.0.1:{running.port}"
    evil = CoordinatorClient(address, pb.ROLE_COMPUTE, security=pki["l1"])
    try:
        anonymous = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="")
        ids = {evil.stub.Join(anonymous, timeout=5).worker_id for _ in range(8)}
        assert ids == {"l1"}  # its certificate's name, each time: one worker
        assert running.ledger.live_workers("compute", 30) == ["l1"]
        before, refused = workers(running), running.service.status_detail()["calls_refused"]
        other = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="l2")
        code, why = code_of(lambda: evil.stub.Join(other, timeout=5))
        assert code == DENIED and "may not act as 'l2'" in why
        observer = pb.JoinRequest(role=pb.ROLE_OBSERVER, host="h", worker_id="")
        code, why = code_of(lambda: evil.stub.Join(observer, timeout=5))
        assert code == DENIED  # a learner's certificate joins as a learner only (the guard)
        assert workers(running) == before  # refused: nothing changed, and counted
        assert running.service.status_detail()["calls_refused"] == refused + 2
        # The learner's own client joins as its name, and again (a restarted learner) at once.
        honest = CoordinatorClient(address, pb.ROLE_COMPUTE, security=pki["l1"])
        try:
            assert honest.join(timeout_s=10).worker_id == "l1"
            honest.heartbeat(pb.HeartbeatRequest())
        finally:
            honest.close()
        assert running.ledger.live_workers("compute", 30) == ["l1"]
    finally:
        evil.close()
        running.stop()


@pytest.mark.timeout(120)
def test_after_a_restart_a_namesake_certificate_cannot_take_a_workers_id(
    tiny_corpus: Path, tmp_path: Path, pki: dict[str, Security]
) -> None:
    # The attack: bindings lived in memory; after a restart an observer's certificate named like
    # learner l1 heartbeated as it first (made-up figures), left as it, and the real learner's
    # join and heartbeats were refused until the lease lapsed.
    running = coordinator(tiny_corpus, tmp_path, pki["coordinator"])
    learner = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, security=pki["l1"])
    try:
        learner.join()
    finally:
        learner.close()
        running.stop()
    running = coordinator(tiny_corpus, tmp_path, pki["coordinator"])  # the same run, a new life
    address = f"127.0.0.1:{running.port}"
    namesake = CoordinatorClient(address, pb.ROLE_OBSERVER, security=pki["namesake"])
    learner = CoordinatorClient(address, pb.ROLE_COMPUTE, security=pki["l1"])
    try:
        before = workers(running)
        refused = running.service.status_detail()["calls_refused"]
        for name, call in {
            "Heartbeat": lambda: namesake.stub.Heartbeat(
                pb.HeartbeatRequest(worker_id="l1", inner_steps=7, tokens_trained=7), timeout=5
            ),
            "Leave": lambda: namesake.stub.Leave(pb.LeaveRequest(worker_id="l1"), timeout=5),
            "Join": lambda: namesake.stub.Join(
                pb.JoinRequest(role=pb.ROLE_OBSERVER, worker_id=""), timeout=5
            ),
        }.items():
            code, why = code_of(call)
            assert code == DENIED, (name, why)
        assert workers(running) == before  # refused: nothing changed, and counted
        assert running.service.status_detail()["calls_refused"] == refused + 3
        stats = running.ledger.live_worker_stats("compute", 30)["l1"]
        assert stats.get("inner_steps") != 7
        # The real learner goes on, without joining again: its heartbeat is its own.
        learner.heartbeat(pb.HeartbeatRequest(inner_steps=3))
        assert running.ledger.live_worker_stats("compute", 30)["l1"]["inner_steps"] == 3
        assert learner.join().worker_id == "l1"
    finally:
        namesake.close()
        learner.close()
        running.stop()
