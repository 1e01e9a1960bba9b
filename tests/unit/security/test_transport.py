"""Identities on every RPC, against a real coordinator on loopback: mutual TLS with certificates
from `diloco certs` (role and name from the certificate), the shared-token mode, and the refusal
to serve plaintext beyond loopback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import grpc_options, start_coordinator
from diloco.errors import DilocoError
from diloco.security.certs import TlsFiles, init_ca, issue, subject_of
from diloco.security.guard import caller_problem
from diloco.security.transport import (
    HANDSHAKE_PATIENCE_S,
    Security,
    check_listen,
    give_up_on_handshake,
    handshake_problem,
    http2_frame_bytes,
)
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
    made = {name: Security(tls=issue(ca, role, name)) for name, role in roles.items()}
    other = tmp_path_factory.mktemp("other-ca")
    init_ca(other, "someone else's CA")
    stranger = issue(other, "learner", "learner-0")
    return {
        **made,
        "stranger": Security(tls=stranger),  # trusts neither the run's coordinator nor is trusted
        "impostor": Security(tls=TlsFiles(stranger.cert, stranger.key, str(ca / "ca.crt"))),
    }


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
    assert "an observer may not call Finish" in caller_problem("Finish", "observer", "o", pb.FinishRequest())
    assert caller_problem("Finish", "operator", "ops", pb.FinishRequest()) == ""
    join = pb.JoinRequest(role=pb.ROLE_DATA, worker_id="learner-0")
    assert "a learner certificate may not join as ROLE_DATA" in caller_problem(
        "Join", "learner", "learner-0", join
    )
    as_compute = pb.JoinRequest(role=pb.ROLE_COMPUTE, worker_id="e")
    assert caller_problem("Join", "evaluator", "e", as_compute).startswith("an evaluator certificate")


@pytest.mark.timeout(120)
def test_mutual_tls_takes_each_callers_role_and_name_from_its_certificate(
    tiny_corpus: Path, tmp_path: Path, certs: dict[str, Security], caplog: pytest.LogCaptureFixture
) -> None:
    running = coordinator(tiny_corpus, tmp_path / "run", certs["coordinator"])
    address = f"127.0.0.1:{running.port}"
    clients: list[CoordinatorClient] = []

    def client(role: int, security: Security) -> CoordinatorClient:
        clients.append(CoordinatorClient(address, role, retry_deadline_s=2, security=security))
        return clients[-1]

    try:
        plain = client(pb.ROLE_COMPUTE, Security())
        # A plaintext client never gets through the TLS handshake, and is told why (not after
        # the whole wait: it would then say only "cannot reach"); so is a certificate from
        # another CA.
        with pytest.raises(DilocoError, match="it runs TLS, so give --tls-cert"):
            plain.wait_ready(60)
        with pytest.raises(DilocoError, match="does not trust your certificate"):
            client(pb.ROLE_COMPUTE, certs["impostor"]).wait_ready(60)
        with pytest.raises(DilocoError, match="signed by your --tls-ca.*CERTIFICATE_VERIFY_FAILED"):
            client(pb.ROLE_COMPUTE, certs["stranger"]).wait_ready(60)
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
        # The log says where each refused kind came from: a refusal may name no one else.
        assert "refused LeaseChunk from 127.0.0.1: " in caplog.text, caplog.text
        assert operator.finish("asked by the operator").run_state == pb.RUN_STATE_FINISHING
    finally:
        for c in clients:
            c.close()
        running.stop()


@pytest.mark.timeout(120)
def test_the_token_mode_refuses_calls_without_the_token(
    tiny_corpus: Path, tmp_path: Path, certs: dict[str, Security], caplog: pytest.LogCaptureFixture
) -> None:
    token = "s3cret-token-of-the-run"
    running = coordinator(tiny_corpus, tmp_path / "run", Security(token=token))
    address = f"127.0.0.1:{running.port}"
    wrong = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(token="x" * 20))
    right = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(token=token))
    none = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security())
    with_tls = CoordinatorClient(address, pb.ROLE_COMPUTE, security=certs["learner-0"])
    try:
        with pytest.raises(DilocoError, match="the coordinator does not speak TLS"):
            with_tls.wait_ready(60)
        # A wrong token and no token are told apart (what was sent, never what was expected).
        said = denied(lambda: wrong.join(10), grpc.StatusCode.UNAUTHENTICATED)
        assert "does not match this coordinator's" in said and token not in said
        assert "needs its token" in denied(lambda: none.join(10), grpc.StatusCode.UNAUTHENTICATED)
        assert right.join().worker_id
        status = right.status()
        assert status["security"] == "token" and status["calls_refused"] == 2, status
        assert "refused Join from 127.0.0.1: a wrong token" in caplog.text, caplog.text
    finally:
        for c in (with_tls, wrong, none, right):
            c.close()
        running.stop()


def test_plaintext_beyond_loopback_is_refused_unless_insecure_is_said() -> None:
    assert check_listen("127.0.0.1", Security()) == ""
    assert check_listen("localhost", Security()) == ""
    with pytest.raises(DilocoError, match="anyone who reaches the port"):
        check_listen("0.0.0.0", Security())
    assert "--insecure" in check_listen("0.0.0.0", Security(insecure=True))
    assert "cleartext" in check_listen("0.0.0.0", Security(token="t" * 16))  # allowed, with a warning


def test_a_handshake_that_keeps_failing_is_named_and_anything_else_is_waited_out() -> None:
    plain, tls = Security(), Security(tls=TlsFiles("c", "k", "ca"))
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7: Socket closed"
    assert "it runs TLS" in handshake_problem(closed, plain)
    assert "does not trust your certificate" in handshake_problem(closed, tls)
    wrong_version = "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: WRONG_VERSION_NUMBER"
    assert "does not speak TLS" in handshake_problem(wrong_version, tls)
    bad_signature = "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: BAD_SIGNATURE"
    assert handshake_problem(bad_signature, tls).endswith("SSL_ERROR_SSL: BAD_SIGNATURE")
    down = "last error: UNKNOWN: ipv4:127.0.0.1:7: Failed to connect to remote host: Connection refused"
    assert handshake_problem(down, plain) == ""  # a coordinator that is down (or restarting)

    # The clock: a problem must last HANDSHAKE_PATIENCE_S; a refused connection in between (a
    # coordinator killed mid-handshake, then restarting) starts the count again.
    since, stop = give_up_on_handshake("tls", None, 100.0)
    assert (since, stop) == (100.0, False)
    assert give_up_on_handshake("tls", since, 100.0 + HANDSHAKE_PATIENCE_S / 2) == (100.0, False)
    assert give_up_on_handshake("", since, 101.5) == (None, False)
    since, _ = give_up_on_handshake("tls", None, 102.0)
    assert give_up_on_handshake("tls", since, 102.0 + HANDSHAKE_PATIENCE_S) == (102.0, True)


def test_a_streamed_piece_is_one_http2_frame_within_what_http2_allows() -> None:
    """Both ends accept frames as large as a piece (the coordinator's from its config), clamped to
    HTTP/2's range: 16 KiB at least, 2^24 - 1 at most (RFC 9113 4.2)."""
    assert http2_frame_bytes(1 << 20) == 1 << 20
    assert http2_frame_bytes(1000) == 1 << 14
    assert http2_frame_bytes(1 << 26) == (1 << 24) - 1
    cfg = RunConfig().with_overrides({"coordinator.stream_chunk_bytes": 1 << 19})
    assert dict(grpc_options(cfg))["grpc.http2.max_frame_size"] == 1 << 19
