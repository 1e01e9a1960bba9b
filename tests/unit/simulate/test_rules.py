"""The model's rules, with the state built by hand and the clock moved by hand (torchft's style)."""

from __future__ import annotations

import math

import pytest

from diloco.simulate import rules
from diloco.simulate.rules import KeptState

EVERY_STEP = KeptState(step_s=2.0)
# A DiLoCo learner whose state dies with it: only landed pushes keep its work (H = 50, P = 2).
PUSHES_ONLY = KeptState(step_s=2.0, state_survives=False, push_interval_s=50.0, fragments=2, push_s=5.0)


def test_one_failure_stops_the_whole_dp_job_and_loses_the_step_in_progress() -> None:
    d = rules.job_failure(1000.5, stepping_since=900.0, down_until=900.0, restart_s=30.0, kept=EVERY_STEP)
    assert d.action == "restart"
    assert d.resume_at == 1030.5
    assert d.lost_s == pytest.approx(0.5)  # 100.5 s of stepping, a step every 2 s
    assert "stops all chips" in d.reason


def test_two_overlapping_failures_restart_the_restart() -> None:
    first = rules.job_failure(100.0, stepping_since=0.0, down_until=0.0, restart_s=30.0, kept=EVERY_STEP)
    # 10 s into the restart another slice fails: the restart begins again, nothing more is lost.
    second = rules.job_failure(
        110.0, stepping_since=None, down_until=first.resume_at, restart_s=30.0, kept=EVERY_STEP
    )
    assert second.action == "restart-again"
    assert second.resume_at == 140.0
    assert second.lost_s == 0.0


def test_overlapping_failures_of_two_learners_stop_only_each_one() -> None:
    a = rules.learner_failure(100.0, stepping_since=0.0, back_at=0.0, restart_s=30.0, kept=EVERY_STEP)
    b = rules.learner_failure(101.0, stepping_since=20.0, back_at=0.0, restart_s=30.0, kept=EVERY_STEP)
    assert (a.action, a.resume_at) == ("restart", 130.0)
    assert (b.action, b.resume_at) == ("restart", 131.0)
    assert "others never wait" in a.reason
    again = rules.learner_failure(
        120.0, stepping_since=None, back_at=a.resume_at, restart_s=30.0, kept=EVERY_STEP
    )
    assert (again.action, again.resume_at, again.lost_s) == ("restart-again", 150.0, 0.0)


def test_elastic_dp_pauses_and_a_failure_during_the_pause_lengthens_it() -> None:
    d = rules.elastic_failure(
        50.0, stepping_since=10.0, paused_until=10.0, reconfigure_s=10.0, kept=EVERY_STEP
    )
    assert (d.action, d.resume_at, d.lost_s) == ("reconfigure", 60.0, 0.0)
    d2 = rules.elastic_failure(
        55.0, stepping_since=None, paused_until=60.0, reconfigure_s=10.0, kept=EVERY_STEP
    )
    assert (d2.action, d2.resume_at) == ("reconfigure-again", 65.0)


def test_a_failure_during_a_push_loses_the_work_that_push_carried() -> None:
    # Pushes every 50 s, each landing 5 s later. At 152 s: pushes at 50, 100, 150; the one at
    # 150 is still on the wire, so the last two landed are 50 and 100: kept up to 50.
    assert rules.push_kept_s(152.0, PUSHES_ONLY) == 50.0
    during = rules.learner_failure(152.0, stepping_since=0.0, back_at=0.0, restart_s=30.0, kept=PUSHES_ONLY)
    assert during.lost_s == pytest.approx(102.0)
    # At 156 s the push of 150 has landed: kept up to 100.
    after = rules.learner_failure(156.0, stepping_since=0.0, back_at=0.0, restart_s=30.0, kept=PUSHES_ONLY)
    assert after.lost_s == pytest.approx(56.0)


def test_local_state_with_a_lag_keeps_work_up_to_the_last_safe_save() -> None:
    kept = KeptState(step_s=0.2, state_every_s=2.0, state_lag_s=0.5)
    assert rules.state_kept_s(0.3, kept) == 0.0
    assert rules.state_kept_s(2.4, kept) == 0.0  # the save at 2.0 is not safe before 2.5
    assert rules.state_kept_s(2.6, kept) == 2.0
    assert rules.lost_work(7.0, kept) == pytest.approx(1.0)


def test_a_failure_during_the_synchronous_outer_step() -> None:
    kept = KeptState(step_s=2.0, state_survives=False, push_s=10.0)
    # Round from 0; the learner finished its H steps at 100, the outer step began at 105.
    before = rules.sync_round_failure(
        108.0, round_started=0.0, stepping_since=0.0, back_at=0.0, done_at=100.0, sync_started=105.0,
        restart_s=30.0, kept=kept,
    )  # fmt: skip
    assert before.action == "restart"
    assert before.lost_s == pytest.approx(100.0)  # its delta had not landed: the round's work is lost
    assert "every learner waits" in before.reason
    landed = rules.sync_round_failure(
        116.0, round_started=0.0, stepping_since=0.0, back_at=0.0, done_at=100.0, sync_started=105.0,
        restart_s=30.0, kept=kept,
    )  # fmt: skip
    assert (landed.action, landed.lost_s) == ("ignore", 0.0)


def test_a_coordinator_failure_halts_merging_but_not_stepping_until_the_bound() -> None:
    d = rules.coordinator_failure(500.0, up_at=0.0, restart_s=30.0)
    assert (d.action, d.resume_at) == ("restart", 530.0)
    assert "learners keep training" in d.reason
    ok, why = rules.merging(510.0, coordinator_up_at=d.resume_at, alive=4, quorum=1)
    assert not ok and "coordinator down" in why
    assert rules.merging(530.0, coordinator_up_at=d.resume_at, alive=4, quorum=1)[0]
    assert rules.may_step(510.0, halted_since=500.0, halt_bound_s=300.0)
    assert not rules.may_step(800.0, halted_since=500.0, halt_bound_s=300.0)
    again = rules.coordinator_failure(520.0, up_at=530.0, restart_s=30.0)
    assert (again.action, again.resume_at) == ("restart-again", 550.0)


def test_a_rejoin_waits_for_the_coordinator_then_pulls() -> None:
    assert rules.rejoin_at(100.0, coordinator_up_at=0.0, pull_s=10.0).resume_at == 110.0
    waiting = rules.rejoin_at(100.0, coordinator_up_at=120.0, pull_s=10.0)
    assert waiting.resume_at == 130.0 and "waits for the coordinator" in waiting.reason


def test_quorum_counts_learners_back_within_a_round() -> None:
    down = [None, None, 90.0, 10.0]  # two up, one down 10 s, one down 90 s (at now = 100)
    assert rules.quorum_members(100.0, down_since=down, window_s=50.0) == 3
    assert not rules.merging(100.0, coordinator_up_at=0.0, alive=3, quorum=4)[0]
    assert rules.merging(100.0, coordinator_up_at=0.0, alive=3, quorum=3)[0]
    assert rules.state_kept_s(math.inf, KeptState(step_s=1.0, state_survives=False)) == 0.0
