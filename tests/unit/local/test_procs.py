"""ProcessGroup: a child started under a prefix command is started under it again when respawned;
a child that crashes says how it ended, and its log keeps its stacks."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from diloco.local.procs import Child, ProcessGroup, descendants
from tests.support import wait_for


def test_a_respawned_child_keeps_its_prefix(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        child = group.spawn("helper", "learner", ["--help"], prefix=["env", "DILOCO_PREFIXED=1"])
        group.wait([child], timeout_s=60)
        again = group.respawn(child)
        assert again.prefix == ["env", "DILOCO_PREFIXED=1"]
        assert list(again.proc.args)[:2] == ["env", "DILOCO_PREFIXED=1"]
        group.wait([again], timeout_s=60)
    finally:
        group.stop()


def test_a_role_that_crashes_below_python_leaves_its_stacks_and_says_how_it_ended(tmp_path: Path) -> None:
    """A segfault in gRPC or torch used to end a role with nothing in its log: the role's logging
    set-up turns it into every thread's stack, and the supervisor names the signal."""
    crash = "from diloco.logs import setup_logging; setup_logging('coordinator'); import ctypes; ctypes.string_at(0)"
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", crash], stdout=log, stderr=subprocess.STDOUT)
    proc.wait(timeout=60)
    child = Child("coordinator", "coordinator", [], proc, log_path)
    group = ProcessGroup(tmp_path)
    assert child.how_it_ended() == "killed by SIGSEGV"
    assert "Fatal Python error: Segmentation fault" in group.tail(child)
    assert "most recent call first" in group.tail(child)


def test_a_kill_9_takes_the_processes_a_child_started_in_sessions_of_their_own(tmp_path: Path) -> None:
    """As torchrun starts its ranks: a kill -9 of the child reaches them at once (a dead node),
    not only its own process group; a gentler signal is left to the child to pass on."""
    rank = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    group = ProcessGroup(tmp_path / "logs")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", rank], stdout=subprocess.PIPE, start_new_session=True, text=True
        )
        child = Child("learner-0", "learner", [], proc, tmp_path / "learner-0.log")
        grandchild = int(proc.stdout.readline())  # type: ignore[union-attr]
        assert descendants(proc.pid) == [grandchild]
        group.signal(child, signal.SIGSTOP)  # a gentler signal: the child's own group alone
        wait_for(lambda: state(proc.pid) == "T", 10, "the child to stop")
        assert state(grandchild) in ("S", "R")
        group.signal(child, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: state(grandchild) in (None, "Z"), 10, "the grandchild to die")
    finally:
        group.stop()


def state(pid: int) -> str | None:
    """A process's state letter from /proc (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
