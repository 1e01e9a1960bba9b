"""The coordinator's byte counts against what a TCP proxy really carried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import wire_check


@pytest.mark.timeout(120)
def test_counted_wire_bytes_match_the_tcp_stream(tmp_path: Path):
    out = tmp_path / "wire.json"
    wire_check.main(["--pushes", "5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["proxy_bytes"] > 100_000
    # Frames, prefixes and headers are counted; only HTTP/2 control frames (settings, pings,
    # window updates) are not, and they are a sliver.
    assert 0.98 <= result["counted_over_proxy"] <= 1.02, result


def test_the_runs_wire_counts_go_on_across_coordinator_lives(tiny_corpus: Path, tmp_path: Path) -> None:
    """Counted in memory, they restarted at zero with each coordinator life: a chaos run's wire bytes
    per token left out every life but the last. Saved in the ledger, a restart goes on from them."""
    from diloco.coordinator.server import start_coordinator
    from diloco.coordinator.wirecount import WireCounter, job_wire_bytes
    from tests.support import tiny_coordinator

    counter = WireCounter()
    counter.call("push")
    counter.add_in_bytes("push", 1000)
    counter.add_in_bytes("init", 500, role="compute")
    again = WireCounter()
    again.restore(json.loads(json.dumps(counter.snapshot())))
    assert again.by_kind() == counter.by_kind() and again.totals() == counter.totals()
    total, joining = job_wire_bytes(counter.snapshot())
    assert total == sum(counter.totals()) and joining == counter.by_kind()["init"]["received"]
    assert job_wire_bytes(None) == (0, 0)

    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, _learner, _):
        config = running.service.config
        first_life = running.service.wire.totals()
        assert sum(first_life) > 0  # the data worker's chunks and the learner's init
    # tiny_coordinator has stopped it (its last counts saved): the next life starts from them.
    resumed = start_coordinator(config, str(tmp_path))
    try:
        assert resumed.service.wire.totals()[0] >= first_life[0]
        assert resumed.service.status_detail()["wire_bytes_in"] >= first_life[0]
    finally:
        resumed.stop()
