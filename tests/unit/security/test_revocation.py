"""Revoking a certificate during a run (`diloco certs revoke`, a coordinator's --tls-crl): the list
signed by the run's CA, read again when it changes, and every call of a revoked certificate
refused by a real mutual-TLS coordinator while the others go on."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from diloco.client import CoordinatorClient
from diloco.errors import DilocoError
from diloco.observe.access import role_of
from diloco.security.certs import CRL_NAME, init_ca, issue
from diloco.security.revocation import RevocationList, revoke, revoked_serials, serial_of
from diloco.security.transport import Security
from diloco.security.watched import RECHECK_S
from diloco.v1 import coordinator_pb2 as pb
from tests.support import cli, one_error_line, run_cli, tiny_coordinator


def serial(path: str) -> int:
    return serial_of(Path(path).read_bytes())


def test_revoke_adds_to_the_cas_list_and_keeps_what_it_held(tmp_path: Path) -> None:
    ca = tmp_path / "pki"
    init_ca(ca)
    ca_pem = (ca / "ca.crt").read_bytes()
    assert RevocationList(ca / CRL_NAME, ca_pem).serials == frozenset()  # `certs init` made it empty
    a, b = issue(ca, "learner", "a"), issue(ca, "data", "b")
    crl, revoked, role, name = revoke(ca, a.cert)
    assert (crl, revoked, role, name) == (ca / CRL_NAME, serial(a.cert), "learner", "a")
    revoke(ca, b.cert)
    revoke(ca, a.cert)  # again: no change
    assert RevocationList(crl, ca_pem).serials == {serial(a.cert), serial(b.cert)}
    # Another CA's certificate, even one with the same CA name, is not this CA's to revoke.
    other = tmp_path / "other"
    init_ca(other)
    with pytest.raises(DilocoError, match="not issued by the CA"):
        revoke(ca, issue(other, "learner", "a").cert)
    # Nor may another CA's list stand in for this one's.
    with pytest.raises(DilocoError, match="not signed by the run's CA"):
        RevocationList(other / CRL_NAME, ca_pem)
    with pytest.raises(DilocoError, match="not a PEM certificate revocation list"):
        revoked_serials(b"nothing", x509.load_pem_x509_certificate(ca_pem))


def test_a_changed_list_is_read_within_a_second_and_a_broken_one_keeps_the_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = tmp_path / "pki"
    init_ca(ca)
    a, b = issue(ca, "learner", "a"), issue(ca, "learner", "b")
    revoke(ca, a.cert)
    listed = RevocationList(ca / CRL_NAME, (ca / "ca.crt").read_bytes())
    now = 1000.0
    assert listed.revoked(serial(a.cert), now) and not listed.revoked(serial(b.cert), now)
    revoke(ca, b.cert)
    assert not listed.revoked(serial(b.cert), now + RECHECK_S / 2)  # the file is looked at once a second
    assert listed.revoked(serial(b.cert), now + RECHECK_S)
    # A file cut short (copied while being written) keeps the list in force, and is said once.
    caplog.set_level(logging.ERROR, logger="diloco.security")
    (ca / CRL_NAME).write_bytes(b"-----BEGIN X509 CRL-----\nMII")
    for i in range(2, 5):
        assert listed.revoked(serial(a.cert), now + i * RECHECK_S)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "the last one stays in force" in said[0], said
    # Mended, it is read again.
    (ca / CRL_NAME).unlink()
    revoke(ca, b.cert)  # a new list: b only
    assert not listed.revoked(serial(a.cert), now + 6 * RECHECK_S)


def test_a_revoked_certificate_cannot_open_the_status_page() -> None:
    class Listed:
        def revoked(self, serial: int, now: float) -> bool:
            return serial == 0xABC

    peer = {"serialNumber": "0ABC", "subject": ((("organizationalUnitName", "observer"),),)}
    assert role_of(peer) == "observer"
    assert role_of(peer, Listed()) == ""  # type: ignore[arg-type]
    assert role_of({**peer, "serialNumber": "0ABD"}, Listed()) == "observer"  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_coordinator_refuses_every_call_of_a_certificate_revoked_while_it_runs(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    ca = tmp_path / "pki"
    init_ca(ca)
    coordinator = Security(tls=issue(ca, "coordinator", "coordinator"), crl=str(ca / CRL_NAME))
    learner = Security(tls=issue(ca, "learner", "learner-0"))
    other = issue(ca, "learner", "learner-1")
    security = {
        "coordinator": coordinator,
        "data": Security(tls=issue(ca, "data", "data-0")),
        "learner": learner,
    }
    with tiny_coordinator(tiny_corpus, tmp_path / "run", {}, security) as (running, first, _):
        address = f"127.0.0.1:{running.port}"
        second = CoordinatorClient(address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(tls=other))
        try:
            second.join()
            assert second.lease_shard().shard_id >= 0
            _, revoked, _, _ = revoke(ca, other.cert)
            deadline = time.monotonic() + 10 * RECHECK_S
            while True:  # within a second or two: the guard looks at the file once a second
                try:
                    second.heartbeat(pb.HeartbeatRequest(worker_id="learner-1"), timeout_s=5)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
                    assert f"learner-1 (learner, serial {revoked:x}) is revoked" in e.details()
                    break
                assert time.monotonic() < deadline, "a revoked certificate was still served"
                time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as caught:
                second.lease_shard()
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # Lost at its first refused call, not a lease TTL later: its shard is back in the pool,
            # and no round waits for it.
            assert running.ledger.binding("learner-1")[2] is False
            assert running.ledger.leases_held("learner-1") == 0
            assert "learner-1" not in running.service._live_learners()
            assert first.status()["certificates_revoked"] == 1
            # The learner whose certificate stands goes on.
            first.heartbeat(pb.HeartbeatRequest(worker_id="learner-0"), timeout_s=5)
            assert first.lease_shard().shard_id >= 0
        finally:
            second.close()


@pytest.mark.timeout(120)
def test_the_cli_revokes_by_name_or_file_and_the_list_needs_mutual_tls(tmp_path: Path) -> None:
    ca = tmp_path / "pki"
    assert cli("certs", "init", "--out", str(ca))[0] == 0
    assert cli("certs", "issue", "--out", str(ca), "--role", "learner", "--name", "host-3")[0] == 0
    code, said = cli("certs", "revoke", "--out", str(ca), "--name", "host-3")
    assert code == 0, said
    assert f"revoked learner host-3 (serial {serial(str(ca / 'host-3.crt')):x})" in said
    assert f"--tls-crl {ca / CRL_NAME}" in said
    code, said = cli("certs", "revoke", "--out", str(ca))
    assert code != 0 and "give one of --name" in one_error_line(said)
    code, said = cli("certs", "revoke", "--out", str(ca), "--name", "nobody")
    assert code != 0 and "cannot read the certificate to revoke" in one_error_line(said)
    done = run_cli(
        ["coordinator", "--tls-crl", str(ca / CRL_NAME), "--workdir", str(tmp_path / "w")], timeout=60
    )
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and "--tls-crl revokes certificates: it needs mutual TLS" in line, done.stderr
    assert "--tls-crl" in cli("coordinator", "--help")[1]
    assert "--tls-crl" not in cli("compute", "--help")[1]
