"""Lease and liveness decisions, as pure functions of (state, now, ttl).

A lease is a deadline: granted at `now` it runs out at now + ttl, and each heartbeat that names it
moves the deadline on. An expired lease returns its chunk or shard to the pool; a worker not heard
from within the ttl is no longer counted live. Row ranges are half-open [start, end).
"""

from __future__ import annotations

from collections.abc import Iterable

Range = tuple[int, int]


def lease_deadline(now: float, ttl_s: float) -> float:
    return now + ttl_s


def is_live(last_seen: float, now: float, ttl_s: float) -> bool:
    return now - last_seen < ttl_s


def normalise(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, merged, non-empty ranges."""
    out: list[Range] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(total: Range, taken: Iterable[Range]) -> list[Range]:
    """The parts of `total` not inside any of `taken`."""
    start, end = total
    out: list[Range] = []
    cursor = start
    for a, b in normalise(taken):
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            out.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        out.append((cursor, end))
    return out


def covered_rows(ranges: Iterable[Range]) -> int:
    return sum(b - a for a, b in normalise(ranges))


def overlaps(ranges: Iterable[Range]) -> bool:
    """True when any two ranges share a row (what exactly-once accounting forbids)."""
    ordered = sorted(r for r in ranges if r[1] > r[0])
    return any(ordered[i][1] > ordered[i + 1][0] for i in range(len(ordered) - 1))
