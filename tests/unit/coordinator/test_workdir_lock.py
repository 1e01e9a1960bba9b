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
from diloco.coordinator.workdir import lock_workdir
from diloco.errors import DilocoError
from tests.support import tiny_coordinator

HOLD = """
import sys, time
from diloco.coordinator.workdir import lock_workdir
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
