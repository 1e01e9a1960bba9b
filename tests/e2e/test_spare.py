"""Warm spares: a supervisor hands a dead process's command line to a process that is already past
its imports, which then runs it with its output in the dead one's log."""

from __future__ import annotations

import time
from pathlib import Path

from diloco.local.procs import ProcessGroup
from diloco.local.spare import Assignment


def test_an_assignment_round_trips_through_one_line() -> None:
    a = Assignment(["compute", "--worker-id", "learner-0"], "/tmp/x.log", {"K": "v"})
    assert Assignment.from_line(a.to_line().decode()) == a
    assert a.to_line().count(b"\n") == 1


def test_respawn_hands_the_role_to_a_warm_spare_and_starts_another(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        first = group.spawn("helper", "data", ["status", "--help"])
        assert group.wait([first], 60) and first.proc.returncode == 0
        group.keep_spares(["data"], per_role=1)
        spare_pid = group.spares["data"][0].proc.pid
        time.sleep(1.0)  # (warm or not, a spare takes the role; warm is only faster)
        second = group.respawn(first)
        assert second.proc.pid == spare_pid, "the spare's process took the role"
        assert second.name == "helper" and second.log_path == first.log_path
        assert group.wait([second], 90) and second.proc.returncode == 0, group.tail(second)
        assert second.log_path.read_text().count("Usage") == 2  # both lives wrote to the one log
        assert len(group.spares["data"]) == 1 and group.spares["data"][0].proc.pid != spare_pid
    finally:
        group.stop(grace_s=10)
    assert all(not c.alive for c in [*group.children, *group.all_spares()])
