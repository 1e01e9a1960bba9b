"""Conditions timed by a clock the caller passes in (`now`), so that a decision driven by how long
something has lasted is a pure function, tested by moving timestamps."""

from __future__ import annotations


def lasting(holds: bool, since: float | None, now: float) -> tuple[float | None, float]:
    """(since when the condition has held, for how long): (None, 0) while it does not hold, so the
    next time it holds the count starts again."""
    if not holds:
        return None, 0.0
    since = now if since is None else since
    return since, now - since
