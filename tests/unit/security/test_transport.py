"""Identities on every RPC, against a real coordinator on loopback: mutual TLS with certificates
from `diloco certs` (role and name from the certificate), the shared-token mode, and the refusal
to serve plaintext beyond loopback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.errors import DilocoError
from diloco.security.certs import init_ca, issue, subject_of
from diloco.security.transport import Security, caller_problem, check_listen
from diloco.v1 import coordinator_pb2 as pb


def denied(call, code=grpc.StatusCode.PERMISSION_DENIED) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value
    return caught.value.details()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Security]:
    ca = tmp_path_factory.mktemp("ca")
    init_ca(ca)
    roles = {"coordinator": "coordinator", "learner-0": "learner", "data-0": "data", "ops": "operator"}
    return {name: Security(tls=issue(ca, role, name)) for name, role in roles.items()}


def coordinator(corpus: Path, workdir: Path, security: Security):
    cfg = RunConfig().with_overrides({"data.dataset": str(corpus), "data.chunk_bytes": 65536})
    return start_coordinator(cfg, str(workdir), security=security)


def test_a_certificate_names_its_role_and_name(certs: dict[str, Security]) -> None:
    assert subject_of(Path(certs["learner-0"].tls.cert).read_bytes()) == ("learner", "learner-0")
    assert certs["data-0"].name() == "data-0"
    with pytest.raises(DilocoError, match="already holds a CA"):
        init_ca(Path(certs["ops"].tls.ca).parent)


def test_who_may_call_what() -> None:
    heartbeat = pb.HeartbeatRequest(worker_id="learner-0")
    assert caller_problem("Heartbeat", "learner", "learner-0", heartbeat) == ""
    assert "may not act as" in caller_problem("Heartbeat", "learner", "learner-1", heartbeat)
    assert "may not call LeaseChunk" in caller_problem(
        "LeaseChunk", "learner", "learner-0", pb.LeaseChunkRequest()
    )
    assert "may not call Finish" in caller_problem("Finish", "observer", "o", pb.FinishRequest())
    assert caller_problem("Finish", "operator", "ops", pb.FinishRequest()) == ""
    join = pb.JoinRequest(role=pb.ROLE_DATA, worker_id="learner-0")
    assert "may not join as ROLE_DATA" in caller_problem("Join", "learner", "learner-0", join)


@pytest.mark.timeout(120)
def test_mutual_tls_takes_each_callers_role_and_name_from_its_certificate(
    tiny_corpus: Path, tmp_path: Path, certs: dict[str, Security]
) -> None:
    running = coordinator(tiny_corpus, tmp_path / "run", certs["coordinator"])
    address = f"127.0.0.1:{running.port}"
    clients: list[CoordinatorClient] = []

    def client(role: int, security: Security) -> CoordinatorClient:
        clients.append(CoordinatorClient(address, role, retry_deadline_s=2, security=security))
        return clients[-1]

    try:
        plain = client(pb.ROLE_COMPUTE, Security())
        with pytest.raises(DilocoError, match="cannot reach"):
            plain.wait_ready(3)  # a plaintext client never gets through the TLS handshake
        learner = client(pb.ROLE_COMPUTE, certs["learner-0"])
        assert learner.worker_id == "learner-0" and learner.join().worker_id == "learner-0"
        assert "may not call LeaseChunk" in denied(learner.lease_chunk)
        assert "may not call Finish" in denied(lambda: learner.finish("mine"))
        learner.worker_id = "learner-1"  # heartbeat for another learner: refused
        assert "may not act as 'learner-1'" in denied(lambda: learner.heartbeat(pb.HeartbeatRequest()))
        learner.worker_id = "learner-0"
        as_data = client(pb.ROLE_DATA, certs["learner-0"])
        assert "may not join as ROLE_DATA" in denied(lambda: as_data.join(10))
        data = client(pb.ROLE_DATA, certs["data-0"])
        data.join()
        assert data.lease_chunk().chunk_id > 0
        operator = client(pb.ROLE_OBSERVER, certs["ops"])
        detail = operator.status()
        assert detail["security"] == "mtls" and detail["calls_refused"] >= 4
        assert operator.finish("asked by the operator").run_state == pb.RUN_STATE_FINISHING
    finally:
        for c in clients:
            c.close()
        running.stop()


@pytest.mark.timeout(120)
def test_the_token_mode_refuses_calls_without_the_token(tiny_corpus: Path, tmp_path: Path) -> None:
    token = "s3cret-token-of-the-run"
    running = coordinator(tiny_corpus, tmp_path / "run", Security(token=token))
    address = f"127.0.0.1:{running.port}"
    wrong = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(token="x" * 20))
    right = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(token=token))
    try:
        assert "needs its token" in denied(lambda: wrong.join(10), grpc.StatusCode.UNAUTHENTICATED)
        assert right.join().worker_id
        assert right.status()["security"] == "token"
    finally:
        wrong.close()
        right.close()
        running.stop()


def test_plaintext_beyond_loopback_is_refused_unless_insecure_is_said() -> None:
    assert check_listen("127.0.0.1", Security()) == ""
    assert check_listen("localhost", Security()) == ""
    with pytest.raises(DilocoError, match="anyone who reaches the port"):
        check_listen("0.0.0.0", Security())
    assert "--insecure" in check_listen("0.0.0.0", Security(insecure=True))
    assert check_listen("0.0.0.0", Security(token="t" * 16)) == ""
