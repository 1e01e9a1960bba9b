"""A coordinator that did not run for seconds heard no heartbeats meanwhile: its workers' deadlines
move on by as much before anything expires (stall.own_stall_s decides, by moved timestamps)."""

from __future__ import annotations

import pytest

from diloco.coordinator.ledger import ChunkLease
from diloco.coordinator.stall import STALL_MIN_S, TICK_S, own_stall_s
from tests.unit.coordinator.ledger_setup import TTL, make


def test_only_a_tick_late_by_seconds_is_a_stall() -> None:
    assert own_stall_s(None, 100.0) == (0.0, "")  # the first tick: nothing to compare
    assert own_stall_s(100.0, 100.0 + TICK_S) == (0.0, "")  # on time
    assert own_stall_s(100.0, 100.0 + TICK_S + STALL_MIN_S - 0.1)[0] == 0.0  # a loaded machine's delay
    late, why = own_stall_s(100.0, 100.0 + TICK_S + 18.0)
    assert late == pytest.approx(18.0) and "did not run for 18.0 s" in why


def test_deadlines_move_on_by_the_stall_so_nobody_is_lost_for_it(ledger, clock) -> None:  # noqa: ANN001
    make(ledger, ["train", "train"])
    ledger.join("d1", "data", "h")
    lease = ledger.lease_chunk("d1", TTL)
    assert isinstance(lease, ChunkLease)
    clock.advance(TTL - 1)  # d1's last heartbeat was then; the coordinator stalls for 5 s more
    clock.advance(5)
    ledger.extend_deadlines(5 + 1)
    reclaimed = ledger.reclaim_expired(TTL)
    assert reclaimed.lost == [] and reclaimed.chunks == []  # its silence was the coordinator's
    clock.advance(TTL + 1)  # silent for real afterwards: lost as ever
    reclaimed = ledger.reclaim_expired(TTL)
    assert reclaimed.lost == [("d1", "data")] and reclaimed.chunks == [lease.chunk_id]


def test_the_ticker_moves_deadlines_on_after_its_own_stall(
    tiny_corpus,
    tmp_path,
    caplog: pytest.LogCaptureFixture,  # noqa: ANN001
) -> None:
    import time

    from diloco.config import RunConfig
    from tests.support import start_coordinator_here

    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    running = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        running.service._stop.set()  # its own ticker stopped: this test ticks by hand
        running.service._ticker.join(5)
        moved: list[float] = []
        running.service.ledger.extend_deadlines = moved.append  # type: ignore[method-assign]
        running.service._ticked_at = time.monotonic() - 20.0  # as if its last tick ended 20 s ago
        running.service.tick()
        assert len(moved) == 1 and moved[0] == pytest.approx(20.0 - TICK_S, abs=1.0)
        assert "the coordinator did not run for" in caplog.text
    finally:
        running.stop()
