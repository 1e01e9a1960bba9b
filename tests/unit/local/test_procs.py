"""ProcessGroup: a child started under a prefix command is started under it again when respawned."""

from __future__ import annotations

from pathlib import Path

from diloco.local.procs import ProcessGroup


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
