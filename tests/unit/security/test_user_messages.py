"""What a person is told when the pieces do not fit: a certificate that cannot serve, an address
without a port, a coordinator that is not there yet; and the CLI's flags say what they do."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from diloco.client import WAIT_NOTICE_S, CoordinatorClient, check_address
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.errors import DilocoError
from diloco.security.certs import init_ca, issue, serving_problem
from diloco.security.transport import Security, connect_cause, handshake_problem
from diloco.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def test_a_coordinator_refuses_at_start_a_certificate_clients_would_refuse(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    ca = tmp_path / "pki"
    init_ca(ca)
    learner, coordinator = issue(ca, "learner", "host-3"), issue(ca, "coordinator", "coordinator")
    assert serving_problem(Path(coordinator.cert).read_bytes()) == ""
    assert "not a PEM certificate" in serving_problem(b"junk")
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus)})
    with pytest.raises(DilocoError, match=r"a learner's certificate \(host-3\), not a server's") as caught:
        start_coordinator(cfg, str(tmp_path / "run"), security=Security(tls=learner))
    assert f"diloco certs issue --out {ca} --role coordinator" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_client_refused_for_the_servers_certificate_purpose_is_told_which_end_to_fix() -> None:
    said = (
        "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
        "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unsupported certificate purpose"
    )
    problem = handshake_problem(said, Security())
    assert "coordinator's certificate is not a server's" in problem and "--role coordinator" in problem
    assert "--tls-ca" not in problem


def test_an_address_must_be_host_and_port() -> None:
    for good in ("127.0.0.1:7777", "coord.example:1", "[::1]:7777", "unix:/tmp/diloco.sock"):
        assert check_address(good) == good
    for bad, why in (
        ("127.0.0.1", "expected HOST:PORT"),
        (":7777", "expected HOST:PORT"),
        ("127.0.0.1:99999", "from 1 to 65535"),
        ("127.0.0.1:http", "from 1 to 65535"),
        ("::1:7777", r"in brackets: \[::1\]:7777"),
    ):
        with pytest.raises(DilocoError, match=why):
            check_address(bad)
        with pytest.raises(DilocoError, match=why):
            CoordinatorClient(bad, pb.ROLE_DATA, security=Security())


def test_a_resolver_error_loses_its_brackets() -> None:
    said = (
        "errors resolving x.invalid:1: [field:hostname lookup error:... x.invalid:1: Domain name not found]"
    )
    assert connect_cause(said) == "Domain name not found"
    refused = "last error: UNKNOWN: ipv4:127.0.0.1:7: Failed to connect to remote host: Connection refused"
    assert connect_cause(refused) == "Connection refused"


@pytest.mark.timeout(60)
def test_a_worker_waiting_for_its_coordinator_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = CoordinatorClient(f"127.0.0.1:{port}", pb.ROLE_DATA, security=Security())
    caplog.set_level(logging.WARNING, logger="diloco.client")
    try:
        with pytest.raises(DilocoError, match="waited 4s; last error: Connection refused\\)$"):
            client.wait_ready(WAIT_NOTICE_S + 2)
    finally:
        client.close()
    said = [r.getMessage() for r in caplog.records if r.name == "diloco.client"]
    assert said == [f"waiting for the coordinator at 127.0.0.1:{port} (connection refused); up to 4s"]


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_the_cli_checks_the_address_and_shows_insecure_only_where_it_acts() -> None:
    code, said = cli("data", "--coordinator", "127.0.0.1", "--insecure")
    assert code == 2 and "expected HOST:PORT" in said and "No such option" not in said
    assert "beyond loopback" in cli("coordinator", "--help")[1]
    for command in ("data", "compute", "evaluator", "status", "eval"):
        code, said = cli(command, "--help")
        assert code == 0 and "--insecure" not in said, command


def test_the_cli_quiets_grpc_core_logs_before_grpc_is_imported() -> None:
    # gRPC reads GRPC_VERBOSITY once, at import: what it sees then is what counts.
    probe = (
        "import os, sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, *args):\n"
        "        if name == 'grpc': print(os.environ.get('GRPC_VERBOSITY'))\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import cli.main\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    for given, seen in ((None, "ERROR"), ("DEBUG", "DEBUG")):
        run_env = env if given is None else {**env, "GRPC_VERBOSITY": given}
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=60
        )
        assert out.stdout.splitlines()[:1] == [seen], out.stderr
