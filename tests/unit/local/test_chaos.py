"""The chaos supervisor's choices: seeded, and every role is hit once per cycle."""

from __future__ import annotations

import statistics

from diloco.local.chaos import ChaosPlan


def test_every_cycle_hits_each_live_role_once() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=1)
    roles = ["coordinator", "data", "learner", "learner", "learner"]
    picks = [plan.pick_role(roles) for _ in range(30)]
    for cycle in range(10):
        assert sorted(picks[3 * cycle : 3 * cycle + 3]) == ["coordinator", "data", "learner"]


def test_roles_without_live_processes_are_skipped() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=2)
    assert plan.pick_role(["coordinator", "data", "learner"]) in {"coordinator", "data", "learner"}
    # The data workers have finished: the bag refills without them.
    picks = {plan.pick_role(["coordinator", "learner"]) for _ in range(6)}
    assert picks == {"coordinator", "learner"}
    assert plan.pick_role([]) is None


def test_same_seed_same_chaos() -> None:
    a, b = ChaosPlan(3.0, seed=7), ChaosPlan(3.0, seed=7)
    roles = ["coordinator", "data", "learner"]
    assert [(a.pick_role(roles), a.next_delay()) for _ in range(10)] == [
        (b.pick_role(roles), b.next_delay()) for _ in range(10)
    ]


def test_delays_average_the_interval_and_have_a_floor() -> None:
    plan = ChaosPlan(interval_s=4.0, seed=3)
    delays = [plan.next_delay() for _ in range(4000)]
    assert min(delays) >= 0.5
    assert 3.7 < statistics.mean(delays) < 4.4


def test_roles_filter_limits_the_victims() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=4, roles=("learner",))
    picks = {plan.pick_role(["coordinator", "data", "learner"]) for _ in range(12)}
    assert picks == {"learner"}
    assert plan.pick_role(["coordinator", "data"]) is None
