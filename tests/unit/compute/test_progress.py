"""A learner's counters as its heartbeats report them: the model's metrics averaged per heartbeat."""

from __future__ import annotations

import pytest

from diloco.compute.progress import Progress
from diloco.coordinator.service.status import mean_metrics


def test_metrics_are_averaged_over_the_steps_since_the_last_heartbeat() -> None:
    p = Progress()
    p.stepped(0.1, 10, 2.0, {"accuracy": 0.5})
    p.stepped(0.1, 10, 1.5, {"accuracy": 0.7})
    assert p.heartbeat([]).train_metrics == pytest.approx({"accuracy": 0.6})
    # no step since: the last means stand (no flicker to nothing between steps)
    assert p.heartbeat([]).train_metrics == pytest.approx({"accuracy": 0.6})
    p.stepped(0.1, 10, 1.0, {"accuracy": 0.9})
    assert p.heartbeat([]).train_metrics == pytest.approx({"accuracy": 0.9})
    assert (p.inner_steps, p.tokens_trained, p.first_loss, p.last_loss) == (3, 30, 2.0, 1.0)
    assert dict(Progress().heartbeat([]).train_metrics) == {}  # a model without metrics


def test_the_runs_metrics_are_each_averaged_over_the_learners_that_report_them() -> None:
    assert mean_metrics([{"accuracy": 0.5, "f1": 0.2}, {"accuracy": 0.7}, {}]) == pytest.approx(
        {"accuracy": 0.6, "f1": 0.2}
    )
    assert mean_metrics([]) == {}


def test_a_resumed_learners_step_time_is_its_own_lifes() -> None:
    """A resume restores the step count (inner_steps), not the time: the step time the syncer's
    grace window and the push catch-up use must come from this life's steps alone (over all 141
    steps it would be 0.014 s, and a round the resumed learner opens would close at once)."""
    p = Progress()
    p.inner_steps = 131  # what resume.py restores
    for _ in range(10):
        p.stepped(0.2, 10, 2.0)
    assert p.inner_steps == 141
    assert p.step_time_s() == pytest.approx(0.2)


def test_the_cpu_a_learner_used_is_counted_from_its_first_step_to_the_loops_end() -> None:
    """Heartbeats carry the process's CPU over the same span as wall_seconds: a learner sharing
    a small machine with other roles is then judged by tokens per CPU-second of its own."""
    p = Progress()
    for _ in range(3):  # start-up work before training: not counted
        sum(i * i for i in range(200_000))
    p.start()
    assert p.cpu_s() < 0.05
    sum(i * i for i in range(2_000_000))  # the loop's work
    p.end(now=p.started + 1.0)
    used = p.cpu_s()
    assert used > 0.01
    sum(i * i for i in range(2_000_000))  # the final flush: after the loop's end, not counted
    assert p.cpu_s() == used
    assert p.heartbeat([]).cpu_seconds == pytest.approx(used)


def test_budget_waits_that_more_steps_followed_are_held_back_inside_the_wall() -> None:
    """The token budget's end game: a learner waits for its next allowance and trains on. Those
    waits are in its training wall (budget_wait_seconds says how much of it); the last wait, that
    no step followed, ends the wall instead."""
    p = Progress()
    p.start()
    t = p.started
    p.stepped(0.1, 10, 2.0)
    p.budget_waited(t + 1.0, t + 1.5)
    p.budget_waited(t + 1.5, t + 2.25)  # asked again: one wait of 1.25 s
    p.stepped(0.1, 10, 2.0)
    p.budget_waited(t + 3.0, t + 5.0)  # the last: the run ended during it
    p.end(now=t + 5.0)
    assert p.budget_wait_s == pytest.approx(3.25)
    assert p.held_back_s == pytest.approx(1.25)
    assert p.wall_s() == pytest.approx(3.0)  # ended where the last wait began
    assert p.heartbeat([]).budget_wait_seconds == pytest.approx(1.25)
