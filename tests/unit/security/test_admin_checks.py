"""What an admin's mistakes with certificates and tokens lead to: refused at once, on one line that
names what to change, never a lost CA, a key left readable, a traceback or a minute's wait."""

from __future__ import annotations

import datetime
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.errors import DilocoError
from diloco.evaluator import rpc_failure_line, run_evaluator
from diloco.security.certs import TlsFiles, init_ca, issue, subject_of
from diloco.security.transport import (
    ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Security,
    check_client,
    check_listen,
    check_serving,
    handshake_problem,
)
from diloco.v1 import coordinator_pb2 as pb

DAY = datetime.timedelta(days=1)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    init_ca(tmp_path / "pki")
    return tmp_path / "pki"


def signed(
    pki: Path, role: str, name: str, *, days: tuple[int, int] = (-1, 1), hosts: tuple[str, ...] = ()
) -> TlsFiles:
    """A certificate from the CA in `pki` made with cryptography directly: valid from days[0] to
    days[1] from now (in the past: expired), naming `hosts` (none: not even 127.0.0.1)."""
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = [
        x509.NameAttribute(NameOID.COMMON_NAME, name),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
    ]
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + days[0] * DAY)
        .not_valid_after(now + days[1] * DAY)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    crt, pem = pki / f"made-{name}.crt", pki / f"made-{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return TlsFiles(str(crt), str(pem), str(pki / "ca.crt"))


# -- 1. issuing never replaces the CA, nor another identity's files -------------------------------


def test_a_name_is_one_plain_token_and_never_the_cas(pki: Path) -> None:
    ca_before = (pki / "ca.crt").read_bytes(), (pki / "ca.key").read_bytes()
    for bad in ("ca", "CA", ".", "..", "", "a/b", "../x", ".hidden", "x y", "-x", "x" * 65, "a\\b"):
        with pytest.raises(DilocoError, match="--name") as caught:
            issue(pki, "learner", bad, force=True)
        assert "\n" not in str(caught.value)
    assert ((pki / "ca.crt").read_bytes(), (pki / "ca.key").read_bytes()) == ca_before
    for good in ("host-3", "learner-0", "gpu_7", "node1.example.org", "a"):
        assert subject_of(Path(issue(pki, "learner", good).cert).read_bytes()) == ("learner", good)


def test_another_identitys_files_are_kept_unless_forced(pki: Path) -> None:
    coordinator = issue(pki, "coordinator", "coordinator-1")
    before = Path(coordinator.cert).read_bytes(), Path(coordinator.key).read_bytes()
    with pytest.raises(DilocoError, match=r"a coordinator's certificate \(coordinator-1\).*--force"):
        issue(pki, "learner", "coordinator-1")
    assert (Path(coordinator.cert).read_bytes(), Path(coordinator.key).read_bytes()) == before
    forced = issue(pki, "learner", "coordinator-1", force=True)
    assert subject_of(Path(forced.cert).read_bytes()) == ("learner", "coordinator-1")


def test_issuing_the_same_role_and_name_again_rotates_it(pki: Path) -> None:
    first = issue(pki, "coordinator", "coordinator", hosts=("10.0.0.2",))
    old_key = Path(first.key).read_bytes()
    again = issue(pki, "coordinator", "coordinator", hosts=("10.0.0.3",))  # a new address: rotation
    assert Path(again.key).read_bytes() != old_key
    check_serving(Security(tls=again))


def test_a_key_alone_a_symlink_or_another_cas_certificate_is_kept(pki: Path, tmp_path: Path) -> None:
    (pki / "lonely.key").write_text("a key someone keeps")
    with pytest.raises(DilocoError, match="key without its certificate"):
        issue(pki, "learner", "lonely")
    other = tmp_path / "other"
    init_ca(other)
    issue(other, "learner", "host-3", out=pki)
    with pytest.raises(DilocoError, match="from another CA"):
        issue(pki, "learner", "host-3")
    (pki / "linked.key").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DilocoError, match="symbolic link"):
        issue(pki, "learner", "linked")


def test_a_ca_whose_key_is_not_its_certificates_issues_nothing(pki: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    init_ca(other)
    (pki / "ca.key").write_bytes((other / "ca.key").read_bytes())
    with pytest.raises(DilocoError, match="ca.key is not the key of a CA certificate"):
        issue(pki, "learner", "host-3")


# -- 2. a key is 0600 whatever was at its path, and a symlink there is replaced, not followed ------


def test_a_key_is_written_0600_over_an_open_file_and_never_through_a_symlink(
    pki: Path, tmp_path: Path
) -> None:
    files = issue(pki, "learner", "host-3")
    os.chmod(files.key, 0o666)
    again = issue(pki, "learner", "host-3")
    assert stat.S_IMODE(os.stat(again.key).st_mode) == 0o600
    target = tmp_path / "target"
    target.write_text("not yours")
    os.unlink(again.key)
    os.symlink(target, again.key)
    issue(pki, "learner", "host-3", force=True)
    assert target.read_text() == "not yours"
    assert not os.path.islink(again.key) and stat.S_IMODE(os.stat(again.key).st_mode) == 0o600
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "ca.key").symlink_to(tmp_path / "nowhere")  # dangling: init_ca finds no CA there
    init_ca(fresh)
    assert not (tmp_path / "nowhere").exists() and not (fresh / "ca.key").is_symlink()
    assert stat.S_IMODE(os.stat(fresh / "ca.key").st_mode) == 0o600
    assert not [p for p in pki.iterdir() if p.name.endswith(".tmp")]


# -- 3. DILOCO_TOKEN is checked and stripped as a token file is, and never beside one --------------


def test_the_token_from_the_environment_is_checked_as_a_files_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in (*ENV.values(), TOKEN_ENV, TOKEN_FILE_ENV):
        monkeypatch.delenv(variable, raising=False)
    for weak in ("x", "   ", " short-token "):
        monkeypatch.setenv(TOKEN_ENV, weak)
        with pytest.raises(DilocoError, match=f"^{TOKEN_ENV}: a token must be at least 16 characters$"):
            Security.from_env()
    monkeypatch.setenv(TOKEN_ENV, " a-token-of-the-run-0123 \n")
    assert Security.from_env().token == "a-token-of-the-run-0123"
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-the-run-0123\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    with pytest.raises(DilocoError, match=f"both {TOKEN_ENV} and --token-file") as caught:
        Security.from_env()
    assert TOKEN_FILE_ENV in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.delenv(TOKEN_ENV)
    assert Security.from_env().token == "a-token-of-the-run-0123"


# -- 4. a token beyond loopback is allowed, with a warning: it travels in cleartext ----------------


def test_a_token_beyond_loopback_is_served_with_a_cleartext_warning() -> None:
    token = Security(token="t" * 16)
    assert "sent in cleartext on every call" in check_listen("0.0.0.0", token)
    assert "use mutual TLS" in check_listen("0.0.0.0", token)
    assert check_listen("127.0.0.1", token) == ""


# -- 5. the evaluator's refusal: one line with the coordinator's reason, exit 2 -------------------


def test_a_failed_call_is_one_line_with_its_details() -> None:
    said = rpc_failure_line(
        grpc.StatusCode.PERMISSION_DENIED, "a learner certificate may not join as ROLE_EVALUATOR"
    )
    assert said == (
        "the coordinator refused the evaluator (PERMISSION_DENIED: a learner certificate may not join as "
        "ROLE_EVALUATOR)"
    )
    assert "stopped answering (UNAVAILABLE" in rpc_failure_line(grpc.StatusCode.UNAVAILABLE, "down")


@pytest.mark.timeout(120)
def test_an_evaluator_with_a_learners_certificate_is_told_why_and_exits_2(
    tiny_corpus: Path, pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    running = start_coordinator(
        cfg, str(tmp_path / "run"), security=Security(tls=issue(pki, "coordinator", "c"))
    )
    learner = issue(pki, "learner", "host-3")
    for part, variable in ENV.items():
        monkeypatch.setenv(variable, getattr(learner, part))
    try:
        address = f"127.0.0.1:{running.port}"
        with pytest.raises(DilocoError, match="PERMISSION_DENIED: a learner certificate may not join"):
            run_evaluator(address, connect_timeout_s=20)
        command = [
            sys.executable,
            "-m",
            "cli",
            "evaluator",
            "--coordinator",
            address,
            "--connect-timeout",
            "20",
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90)
        assert done.returncode == 2, done.stderr
        errors = [line for line in done.stderr.splitlines() if "may not join as ROLE_EVALUATOR" in line]
        assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    finally:
        running.stop()


# -- 6. TLS files a coordinator cannot serve with: refused at start, before anything is written ---


def test_a_coordinator_refuses_a_key_or_ca_it_cannot_serve_with(
    tiny_corpus: Path, pki: Path, tmp_path: Path
) -> None:
    coordinator, other = issue(pki, "coordinator", "coordinator"), issue(pki, "learner", "host-3")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus)})
    cases = {
        "--tls-key": TlsFiles(coordinator.cert, other.key, coordinator.ca),
        "--tls-ca": TlsFiles(coordinator.cert, coordinator.key, str(garbage)),
        "--tls-cert": TlsFiles(str(garbage), coordinator.key, coordinator.ca),
    }
    for flag, files in cases.items():
        with pytest.raises(DilocoError, match=f"^{flag} ") as caught:
            start_coordinator(cfg, str(tmp_path / "run"), security=Security(tls=files))
        assert "port" not in str(caught.value) and "\n" not in str(caught.value)
        assert not (tmp_path / "run").exists()


def test_a_coordinator_refuses_an_expired_certificate(pki: Path) -> None:
    expired = signed(pki, "coordinator", "coordinator", days=(-30, -1))
    with pytest.raises(
        DilocoError, match=r"^--tls-cert .*\(.*: coordinator coordinator\) expired on 20\d\d-"
    ):
        check_serving(Security(tls=expired))


# -- 7, 8, 10. a client's files: checked before it connects, for every role ---------------------


def test_a_client_whose_certificate_is_not_one_is_told_so_on_one_line(pki: Path, tmp_path: Path) -> None:
    good = issue(pki, "data", "data-0")
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    bad = Security(tls=TlsFiles(str(garbage), good.key, good.ca))
    with pytest.raises(DilocoError, match="^--tls-cert .* is not a PEM certificate"):
        bad.name()
    for worker_id in (None, "data-0"):  # with --worker-id, name() is not asked
        with pytest.raises(DilocoError, match="^--tls-cert .* is not a PEM certificate"):
            CoordinatorClient("127.0.0.1:1", pb.ROLE_DATA, worker_id=worker_id, security=bad)


def test_a_client_whose_key_is_not_its_certificates_is_refused_before_connecting(pki: Path) -> None:
    mine, theirs = issue(pki, "learner", "host-3"), issue(pki, "learner", "host-4")
    mismatched = Security(tls=TlsFiles(mine.cert, theirs.key, mine.ca))
    started = time.monotonic()
    for worker_id in (None, "host-3"):
        with pytest.raises(DilocoError, match=r"^--tls-key .*host-4.key is not the key of that certificate"):
            CoordinatorClient("127.0.0.1:1", pb.ROLE_COMPUTE, worker_id=worker_id, security=mismatched)
    assert time.monotonic() - started < 5
    check_client(Security(tls=mine))


def test_an_expired_or_future_client_certificate_is_named_not_blamed_on_the_ca(pki: Path) -> None:
    expired = signed(pki, "learner", "host-3", days=(-30, -1))
    with pytest.raises(
        DilocoError, match=r"^your certificate \(.*: learner host-3\) expired on 20\d\d-"
    ) as caught:
        CoordinatorClient("127.0.0.1:1", pb.ROLE_COMPUTE, security=Security(tls=expired))
    assert "--role learner --name host-3" in str(caught.value)
    future = signed(pki, "learner", "host-5", days=(2, 30))
    with pytest.raises(DilocoError, match="is not valid before .*clock"):
        check_client(Security(tls=future))


# -- 9. a coordinator certificate for another host: named at once -------------------------------


def test_a_hostname_mismatch_is_named_with_the_command_that_fixes_it(pki: Path) -> None:
    said = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:7070: Custom verification "
        "check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
    )
    mine = Security(tls=issue(pki, "learner", "host-3"))
    problem = handshake_problem(said, mine, "10.0.0.2:7070")
    assert "does not name the address you dial (10.0.0.2)" in problem
    assert f"diloco certs issue --out {pki} --role coordinator --name <its name> --host 10.0.0.2" in problem
    assert "--host <that address>" in handshake_problem(said, mine)


@pytest.mark.timeout(60)
def test_a_client_stops_at_once_at_a_coordinator_certificate_for_another_host(
    tiny_corpus: Path, pki: Path, tmp_path: Path
) -> None:
    elsewhere = signed(pki, "coordinator", "coordinator", hosts=("elsewhere.example",))
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    running = start_coordinator(cfg, str(tmp_path / "run"), security=Security(tls=elsewhere))
    client = CoordinatorClient(
        f"127.0.0.1:{running.port}", pb.ROLE_DATA, security=Security(tls=issue(pki, "data", "d"))
    )
    started = time.monotonic()
    try:
        with pytest.raises(DilocoError, match="certificate does not name the address you dial"):
            client.wait_ready(40)
        assert time.monotonic() - started < 15
    finally:
        client.close()
        running.stop()
