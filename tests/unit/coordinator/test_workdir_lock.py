"""One coordinator per workdir: a second one would share the ledger and the checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.coordinator import workdir as workdir_module
from diloco.coordinator.server import start_coordinator
from diloco.coordinator.workdir import lock_workdir, workdir_holder
from diloco.errors import DilocoError
from tests.support import tiny_coordinator

HOLD = """
import sys, time
from diloco.coordinator.workdir import lock_workdir, workdir_holder
held = lock_workdir(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_second_coordinator_on_a_running_ones_workdir_is_refused(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workdir_module, "LOCK_WAIT_S", 0.3)
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, _, _):
        with pytest.raises(DilocoError, match=f"another coordinator \\(pid {os.getpid()}\\)"):
            start_coordinator(running.service.config, str(tmp_path))
        assert running.service.fragments, "the running one is untouched"
    # Stopped, it let go: the next start on the workdir resumes it.
    resumed = start_coordinator(running.service.config, str(tmp_path))
    resumed.stop()


@pytest.mark.timeout(60)
def test_a_killed_holder_lets_go_at_once(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock_file = tmp_path / "state" / "coordinator.lock"
        assert lock_file.read_text() == str(holder.pid)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        held = lock_workdir(str(tmp_path))  # no wait beyond the dead one's exit
        try:
            assert lock_file.read_text() == str(os.getpid())  # written before lock_workdir returns
        finally:
            held.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


@pytest.mark.timeout(60)
def test_a_job_on_a_workdir_in_use_is_refused_before_it_touches_anything(tmp_path: Path) -> None:
    """A second `diloco run` on a live job's workdir once removed the live job's coordinator.json
    (its status page link and `status --workdir`) and rewrote its run.toml before its coordinator
    was refused: the holder is asked first, without waiting, and left holding."""
    from diloco.local.launch import LocalRun
    from diloco.local.options import LocalRunOptions

    assert workdir_holder(str(tmp_path)) is None  # nothing there yet
    root = Path(__file__).resolve().parents[3]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (tmp_path / "coordinator.json").write_text("{}")
        assert workdir_holder(str(tmp_path)) == str(holder.pid)
        job = LocalRun(LocalRunOptions(workdir=str(tmp_path), minutes=0.1))
        with pytest.raises(DilocoError, match=f"is in use: its coordinator \\(pid {holder.pid}\\)"):
            job.run()
        assert (tmp_path / "coordinator.json").exists() and not (tmp_path / "run.toml").exists()
    finally:
        holder.kill()
        holder.wait(10)
    assert workdir_holder(str(tmp_path)) is None


@pytest.mark.timeout(60)
def test_a_start_that_fails_after_serving_stops_what_it_started(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import threading

    from diloco.config import RunConfig
    from diloco.coordinator import server as server_module

    def failing_observers(*args: object, **kwargs: object) -> None:
        raise OSError("the page's port went away")

    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    with socket.socket() as s:  # a port of its own, to ask after the failure
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(server_module, "start_observers", failing_observers)
    with pytest.raises(OSError, match="went away"):
        start_coordinator(cfg, str(tmp_path), port=port)
    # The server, the merger, the publisher and the ticker it had started are gone, and so is the
    # ledger's hold: a second start on the workdir serves it alone.
    alive = {t.name for t in threading.enumerate()}
    assert not alive & {"merger", "publisher", "syncer-tick"}, alive
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    monkeypatch.undo()
    again = start_coordinator(cfg, str(tmp_path))
    again.stop()
