"""ProcessGroup: a child started under a prefix command is started under it again when respawned;
a child that crashes says how it ended, and its log keeps its stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from diloco.local.procs import Child, ProcessGroup


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
