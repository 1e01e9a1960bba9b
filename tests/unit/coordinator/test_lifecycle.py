"""The run's life and the publisher's pacing: pure decisions, tested by moving numbers, never by sleeping."""

import pytest

from diloco.coordinator.lifecycle import FINISHED, FINISHING, RUNNING, may_enter, next_run_state
from diloco.coordinator.service.publisher import GIVE_UP_AT_SHUTDOWN_AFTER, publish_pause, publish_retry


def state_after(current, **facts):
    base = {"tokens_merged": 0, "budget": 1000, "live_learners": 2, "work_unpublished": False}
    return next_run_state(current, **{**base, **facts})


def test_a_run_finishes_once_the_merged_tokens_reach_the_budget():
    assert state_after(RUNNING, tokens_merged=999).state is None
    change = state_after(RUNNING, tokens_merged=1000)
    assert change.state == FINISHING and "1000" in change.reason


def test_without_a_budget_a_run_goes_on():
    assert state_after(RUNNING, tokens_merged=10**12, budget=0).state is None


def test_a_finishing_run_waits_for_every_learner_and_every_publish():
    assert "2 learner" in state_after(FINISHING).reason
    assert state_after(FINISHING, live_learners=0, work_unpublished=True).state is None
    assert state_after(FINISHING, live_learners=0).state == FINISHED


def test_a_finished_run_stays_finished():
    assert state_after(FINISHED, live_learners=0, tokens_merged=10**9).state is None
    assert not may_enter(FINISHED, RUNNING) and not may_enter(FINISHED, FINISHING)
    assert may_enter(RUNNING, FINISHING) and may_enter(FINISHING, FINISHED)
    assert may_enter(RUNNING, FINISHED)  # asked to finish with nobody there
    assert not may_enter(FINISHING, FINISHING)


def test_publishes_are_spaced_only_under_a_burst():
    assert publish_pause(started=10.0, now=10.2, min_interval_s=1.0) == pytest.approx(0.8)
    assert publish_pause(started=10.0, now=12.0, min_interval_s=1.0) == 0.0
    assert publish_pause(started=10.0, now=10.0, min_interval_s=0.0) == 0.0


def test_failed_publishes_back_off_and_give_up_only_at_shutdown():
    waits = [publish_retry(n, stopping=False) for n in range(1, 10)]
    assert waits == sorted(waits) and waits[0] == pytest.approx(0.4) and waits[-1] == 5.0
    assert publish_retry(100, stopping=False) == 5.0  # while the run goes on, merges are kept
    assert publish_retry(GIVE_UP_AT_SHUTDOWN_AFTER - 1, stopping=True) is not None
    assert publish_retry(GIVE_UP_AT_SHUTDOWN_AFTER, stopping=True) is None
