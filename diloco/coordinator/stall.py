"""The coordinator's own stalls. A coordinator that could not run for seconds (starved of CPU on a
loaded machine, a disk that took that long to sync, a stop signal) heard no heartbeat meanwhile,
though its workers sent them: their silence is its own, and counting it against them expires their
leases and marks them lost (measured: an 18 s stall under the test suite's load; the learner came
back through a new join, leased its shards again and trained their rows twice)."""

from __future__ import annotations

# How often the ticker runs; a tick later than this by STALL_MIN_S or more is a stall. Two
# seconds: well above a loaded machine's scheduling delays, well below a lease (15-30 s).
TICK_S = 0.25
STALL_MIN_S = 2.0


def own_stall_s(last_tick_end: float | None, now: float, period_s: float = TICK_S) -> tuple[float, str]:
    """Seconds every worker's deadline moves on for the time this coordinator did not run (from the
    end of its last tick to now, less the period between ticks), and why ("" and 0: no stall)."""
    if last_tick_end is None:
        return 0.0, ""
    late = now - last_tick_end - period_s
    if late < STALL_MIN_S:
        return 0.0, ""
    return late, f"the coordinator did not run for {late:.1f} s: its workers' deadlines move on as much"
