"""When a learner copies its state to disk (state_cadence.copy_due): moved timestamps, no sleeping."""

from __future__ import annotations

import math

from diloco.compute.state_cadence import copy_due


def due(now: float, **kw: object) -> bool:
    args = {"last_copy": 100.0, "last_cost_s": 0.01, "every_s": 2.0, "max_share": 0.05}
    return copy_due(now, **{**args, **kw}).due  # type: ignore[arg-type]


def test_a_cheap_copy_comes_every_every_s() -> None:
    """A push does not bring a copy forward: the push journal keeps an older state resumable."""
    assert due(0.0, last_copy=-math.inf)  # the first copy: at once
    assert not due(101.0)
    assert due(102.0)


def test_a_costly_copy_waits_until_its_cost_is_within_the_share() -> None:
    """1.7 s a copy (an 86 M-parameter GPT) at 5%: one copy per 34 s."""
    kw = {"last_cost_s": 1.7, "max_share": 0.05}
    assert not due(102.0, **kw)
    assert not due(133.0, **kw)
    assert due(134.0, **kw)
    verdict = copy_due(110.0, last_copy=100.0, last_cost_s=1.7, every_s=2.0, max_share=0.05)
    assert not verdict.due and "cost 1.70s" in verdict.reason and "next in 24.0s" in verdict.reason
    assert verdict.held_by_cost


def test_every_s_still_bounds_a_copy_within_its_budget() -> None:
    assert not due(105.0, every_s=10.0)
    assert not copy_due(105.0, last_copy=100.0, last_cost_s=0.01, every_s=10.0, max_share=0.05).held_by_cost
    assert due(110.0, every_s=10.0)
