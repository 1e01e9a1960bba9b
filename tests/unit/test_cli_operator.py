"""What an operator meets at the command line: a port in use or a workdir that cannot be written is
one line naming it (never a traceback); `diloco status --watch` waits out a coordinator's restart;
`diloco finish` finishes a run started role by role, with the operator's identity only."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from cli.common import os_error_line
from cli.main import app
from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.errors import DilocoError
from diloco.local.tls import SUPERVISOR
from diloco.observe.http import GuardedServer
from diloco.observe.watch import unreachable_line, watch_status
from diloco.observe.worker_metrics import serve_worker_metrics
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb
from tests.support import cli, mtls_job, one_error_line, run_cli, tls_flags

# Each test starts without identity flags in the environment, and what a command set is undone.
pytestmark = pytest.mark.usefixtures("no_identity_in_env")

TOKEN = "a-token-of-the-run-0123456789"


@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


# -- a port in use, a workdir that cannot be written ----------------------------------------------


def test_an_os_error_is_one_line_naming_its_path() -> None:
    assert os_error_line(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run")) == (
        "/mnt/ro/run: Read-only file system"
    )
    assert os_error_line(OSError(errno.EACCES, "Permission denied", "a", None, "b")) == (
        "a -> b: Permission denied"
    )
    assert os_error_line(OSError(errno.EADDRINUSE, "Address already in use")) == "Address already in use"
    assert os_error_line(OSError("disk on fire")) == "disk on fire"


def test_a_metrics_port_in_use_names_the_port_and_the_endpoint() -> None:
    with port_in_use() as port:
        for role, what in (("learner", "the learner's /metrics"), ("data", "the data worker's /metrics")):
            with pytest.raises(DilocoError, match=f"cannot serve {what} .* on 127.0.0.1:{port}: .*in use"):
                serve_worker_metrics(role, port, "127.0.0.1", dict, lambda: "w")
        with pytest.raises(DilocoError, match=f"the status page .* 127.0.0.1:{port}"):
            GuardedServer("127.0.0.1", port, {}, security=Security(), access_token="", what="the status page")


@pytest.mark.timeout(120)
def test_diloco_data_and_compute_with_a_metrics_port_in_use_say_so_in_one_line() -> None:
    with port_in_use() as port:
        for command, what in (("data", "data worker"), ("compute", "learner")):
            args = [
                command,
                "--coordinator",
                "127.0.0.1:9",
                "--metrics-port",
                str(port),
                "--connect-timeout",
                "1",
            ]
            done = run_cli(args, timeout=90)
            line = one_error_line(done.stderr)
            assert done.returncode == 2, done.stderr
            assert f"{what}'s /metrics (--metrics-port) on 127.0.0.1:{port}: Address already in use" in line


@pytest.mark.timeout(120)
def test_a_coordinator_whose_page_port_is_in_use_says_so_in_one_line(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    with port_in_use() as port:
        args = ["coordinator", "--workdir", str(tmp_path / "w"), "--dataset", str(tiny_corpus)]
        done = run_cli([*args, "--http-port", str(port)], timeout=90)
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and f"127.0.0.1:{port}: Address already in use" in line, done.stderr


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing may be written in: mode 0500, or as root (whom modes do not stop) a
    read-only tmpfs, unmounted after."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o500)
        yield where
        where.chmod(0o700)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"no read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.timeout(120)
def test_a_workdir_that_cannot_be_written_is_one_line_naming_it(read_only_dir: Path) -> None:
    workdir = read_only_dir / "run1"
    for args in (["coordinator", "--dataset", "stdlib"], ["run", "--minutes", "0.1"]):
        done = run_cli([*args, "--workdir", str(workdir)], timeout=90)
        line = one_error_line(done.stderr)
        assert done.returncode == 2 and line.startswith(f"error: {workdir}"), done.stderr
        assert any(why in line for why in ("Read-only file system", "Permission denied")), line


@pytest.mark.timeout(120)
def test_a_workdir_under_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = run_cli(["coordinator", "--workdir", str(tmp_path / "a-file" / "run"), "--dataset", "stdlib"], 90)
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and f"{tmp_path / 'a-file'}" in line and "Not a directory" in line, line


# -- status --watch across a coordinator's restart ------------------------------------------------


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7: Connection refused"


def test_an_outage_is_shown_from_its_first_failed_refresh_until_an_answer() -> None:
    answers: list[object] = [{"n": 1}, Unavailable(), Unavailable(), Unavailable(), {"n": 2}, Unavailable()]
    t = [time.mktime((2026, 1, 2, 12, 0, 0, 0, 0, -1))]

    def fetch() -> dict:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    shown: list[tuple[object, object]] = []
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        t[0] += 5

    watch_status(
        fetch, lambda d, down: shown.append((d, down)), 5, now=lambda: t[0], sleep=sleep, refreshes=6
    )
    assert slept == [5] * 5
    assert shown[0] == ({"n": 1}, None) and shown[4] == ({"n": 2}, None)
    assert [down for _, down in shown[1:4]] == [
        f"coordinator unreachable since 12:00:05 ({s} s): Connection refused" for s in (0, 5, 10)
    ]
    assert shown[5][1] == "coordinator unreachable since 12:00:25 (0 s): Connection refused"  # a new outage


def test_a_refusal_that_waiting_would_not_change_ends_the_watch() -> None:
    class Denied(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.PERMISSION_DENIED

    def fetch() -> dict:
        raise Denied()

    with pytest.raises(Denied):
        watch_status(fetch, lambda d, down: None, 1, sleep=lambda s: None, refreshes=3)
    assert unreachable_line(100.0, 90.0, "x").endswith("(0 s): x")  # a clock stepped back


def tiny_config(corpus: Path) -> RunConfig:
    return RunConfig().with_overrides({"data.dataset": str(corpus), "data.chunk_bytes": 65536})


@pytest.mark.timeout(120)
def test_status_watch_waits_out_a_coordinator_restart(tiny_corpus: Path, tmp_path: Path) -> None:
    """`diloco status --watch` against a real coordinator that is stopped and started again on its
    port: the outage is shown, and the tables come back once it answers; the command never exits."""
    workdir = str(tmp_path / "w")
    running = start_coordinator(tiny_config(tiny_corpus), workdir)
    port = running.port
    result: dict[str, object] = {}

    def watch() -> None:
        r = CliRunner().invoke(
            app, ["status", "--coordinator", f"127.0.0.1:{port}", "--watch", "0.2", "--refreshes", "40"]
        )
        result.update(code=r.exit_code, out=r.output, exception=r.exception)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        time.sleep(1.5)
        running.stop()
        time.sleep(2.0)
        running = start_coordinator(tiny_config(tiny_corpus), workdir, port=port)
        watcher.join(timeout=60)
    finally:
        running.stop()
    assert not watcher.is_alive()
    out = str(result["out"])
    assert result["code"] == 0, (result, out)
    down = out.index("coordinator unreachable since")
    assert "run running · coordinator epoch 1" in out[:down]  # the tables before the outage
    assert "s): " in out[down:].splitlines()[0]
    assert out.rfind("coordinator unreachable") < out.index("coordinator epoch 2")  # and after it


# -- diloco finish --------------------------------------------------------------------------------


def run_state(address: str, security: Security) -> str:
    client = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=10, security=security)
    try:
        return client.status()["run_state"]
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_finish_with_a_token_needs_the_token(tiny_corpus: Path, tmp_path: Path) -> None:
    running = start_coordinator(tiny_config(tiny_corpus), str(tmp_path / "w"), security=Security(token=TOKEN))
    address = f"127.0.0.1:{running.port}"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    try:
        code, out = cli("finish", "--coordinator", address)
        assert code == 2 and "UNAUTHENTICATED" in one_error_line(out), out
        assert run_state(address, Security(token=TOKEN)) == "running"
        code, out = cli(
            "finish", "--coordinator", address, "--token-file", str(token_file), "--reason", "done"
        )
        assert code == 0 and out.strip() in ("run finishing", "run finished"), out
        assert run_state(address, Security(token=TOKEN)) in ("finishing", "finished")
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_finish_under_mutual_tls_takes_an_operator_certificate(tiny_corpus: Path, tmp_path: Path) -> None:
    """A `diloco run`-like workdir (its CA in tls/, its coordinator.json): an observer's certificate
    is refused, `--workdir` finishes the run with the job's supervisor's (its operator)."""
    workdir = tmp_path / "job"
    with mtls_job(tiny_corpus, workdir) as (_, address, certs):
        code, out = cli("finish", "--coordinator", address, *tls_flags(certs["status"]))
        line = one_error_line(out)
        assert code == 2 and "refused to finish" in line and "--role operator" in line, out
        assert run_state(address, Security(tls=certs[SUPERVISOR])) == "running"
        code, out = cli("finish", "--workdir", str(workdir), "--reason", "operator says so")
        assert code == 0 and out.strip() in ("run finishing", "run finished"), out
        deadline = time.monotonic() + 10  # no learner to wait for: finished at the next tick
        while run_state(address, Security(tls=certs[SUPERVISOR])) != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        code, out = cli("status", "--workdir", str(workdir), "--json")
        assert code == 0 and json.loads(out)["run_state"] == "finished", out
    # Its coordinator.json outlives it: asked after, the job has ended (not "connection refused").
    code, out = cli("status", "--workdir", str(workdir))
    assert code == 2 and "coordinator is not running: the job has ended" in one_error_line(out), out


def test_finish_needs_an_address() -> None:
    code, out = cli("finish")
    assert code == 2 and "give --coordinator" in one_error_line(out), out
    code, out = cli("finish", "--coordinator", "nohost")
    assert code == 2 and "HOST:PORT" in out, out
