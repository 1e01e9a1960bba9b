"""The fork server: processes forked from one warm interpreter behave as processes of their own
(a session, a log, an exit code, a kill -9, CPU time counted), and start without importing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.local.procs import ProcessGroup
from tests.support import start_coordinator


@pytest.mark.timeout(120)
def test_forked_processes_run_the_cli_exit_and_die_like_their_own(tiny_corpus: Path, tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    group.use_fork_server()
    try:
        short = group.spawn("help", "tool", ["--help"])
        assert group.wait([short], 60) and short.proc.returncode == 0
        assert "Usage" in short.log_path.read_text()
        assert short.cpu_s is not None and short.cpu_s >= 0

        address = start_coordinator(
            group, tmp_path / "coord", ["--dataset", str(tiny_corpus), "--http-port", "0"]
        )
        coordinator = group.by_role("coordinator")[0]
        assert address and coordinator.alive
        assert os.getpgid(coordinator.proc.pid) == coordinator.proc.pid  # a session of its own
        # The signals it ignores are a fresh interpreter's (SIGPIPE among them)...
        assert ignored_signals(coordinator.proc.pid) == ignored_signals(None)
        # ...so a client that closes its connection before the reply is written costs the
        # coordinator a BrokenPipeError, not its life (at SIGPIPE's default it died at once).
        info = json.loads((tmp_path / "coord" / "coordinator.json").read_text())
        for _ in range(5):
            close_mid_request(info["http_port"])
            time.sleep(0.1)
        assert coordinator.alive, f"{coordinator.how_it_ended()}\n{group.tail(coordinator)}"
        group.signal(coordinator, signal.SIGKILL)
        assert group.wait([coordinator], 10)
        assert coordinator.proc.returncode == -signal.SIGKILL and coordinator.cpu_s is not None

        again = group.respawn(coordinator)  # a supervisor's restart, forked too
        info = tmp_path / "coord" / "coordinator.json"
        deadline = time.monotonic() + 30
        while again.alive and time.monotonic() < deadline:
            if info.exists() and "epoch=2" in again.log_path.read_text():
                break
            time.sleep(0.1)
        assert again.alive and "epoch=2" in again.log_path.read_text(), group.tail(again)
        assert group.cpu_seconds_by_role()["coordinator"] > 0
    finally:
        group.stop()
    assert group.fork_server is None
    assert not again.alive and again.proc.returncode == 0  # SIGTERM: it left cleanly


def ignored_signals(pid: int | None) -> str:
    """The SigIgn mask of `pid`, or (None) of a fresh `python` started here."""
    if pid is None:
        code = "print([l for l in open('/proc/self/status') if l.startswith('SigIgn')][0])"
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
    return next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn")
    )


def close_mid_request(port: int) -> None:
    """Ask the page server for /metrics and close the connection without reading the reply, as a
    browser that navigates away does: the reply's first write reaches a closed socket, whose
    reset makes the next write fail (measured: SIGPIPE killed the coordinator at the first try)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
