"""The syncer's pure decisions about rounds: when one closes (quorum, grace window), which pushes
it takes (staleness, distinct learners), and how late a push came."""

import pytest

from diloco.config import SyncConfig
from diloco.coordinator.syncer import (
    Arrival,
    RoundState,
    decide_close,
    grace_window,
    late_in_round_by,
    missed_round_by,
    quorum_needed,
    staleness_refusal,
)


def sync_config(**changes) -> SyncConfig:
    """A SyncConfig that only does what a test asks: every live learner, no grace window, no
    overlap, plain mean, no stale push."""
    base = {"quorum": 0, "merge": "mean", "grace_factor": 0.0, "overlap_steps": 0, "max_staleness": 0}
    return SyncConfig(**{**base, **changes})


# -- closing a round ------------------------------------------------------------------------------


def arrival(worker, at, tokens=100, steps=10, base=0):
    return Arrival(worker_id=worker, tokens=tokens, steps=steps, arrived_at=at, base_version=base)


LIVE3 = {"a", "b", "c"}


def test_quorum_needed():
    assert quorum_needed(sync_config(quorum=0), 3) == 3
    assert quorum_needed(sync_config(quorum=1), 3) == 1
    assert quorum_needed(sync_config(quorum=5), 3) == 3  # never more than are alive
    assert quorum_needed(sync_config(quorum=0), 0) == 1


def test_quorum_one_closes_on_first_push():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0)])
    decision = decide_close(state, now=1.0, policy=sync_config(quorum=1), live_learners=LIVE3)
    assert decision.close


def test_quorum_all_waits_for_every_live_learner():
    policy = sync_config(quorum=0)
    state = RoundState(fragment=0, version=0, opened_at=0.0)
    state.arrivals.append(arrival("a", 1.0))
    assert not decide_close(state, 100.0, policy, LIVE3).close
    state.arrivals.append(arrival("b", 2.0))
    d = decide_close(state, 100.0, policy, LIVE3)
    assert not d.close
    assert "2/3" in d.reason
    state.arrivals.append(arrival("c", 3.0))
    assert decide_close(state, 3.0, policy, LIVE3).close


def test_quorum_two_counts_distinct_learners():
    policy = sync_config(quorum=2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 2.0)])
    assert not decide_close(state, 5.0, policy, LIVE3).close
    state.arrivals.append(arrival("b", 3.0))
    assert decide_close(state, 5.0, policy, LIVE3).close


def test_the_first_round_after_a_restart_waits_for_the_pushes_it_dropped():
    """A restart dropped a's and b's pushes; each sends its own again at its next heartbeat. The
    round waits for both (bounded by awaited_until) instead of merging a's alone at quorum 1."""
    policy = sync_config(quorum=1, grace_factor=0.0)
    state = RoundState(fragment=0, version=3, opened_at=0.0, arrivals=[arrival("a", 1.0, base=3)])
    d = decide_close(state, 1.0, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0)
    assert not d.close and "1 push(es) the restart dropped" in d.reason and d.recheck_at == 6.0
    assert decide_close(state, 6.0, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0).close  # bounded
    # b came back: nothing else is awaited (c pushed nothing before the restart)
    state.arrivals.append(arrival("b", 2.5, base=3))
    assert decide_close(state, 2.5, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0).close
    # an awaited learner that is no longer live is not waited for
    alone = RoundState(fragment=0, version=3, opened_at=0.0, arrivals=[arrival("a", 1.0, base=3)])
    assert decide_close(alone, 1.0, policy, {"a", "c"}, awaited={"a", "b"}, awaited_until=6.0).close


def test_a_push_that_joins_a_round_late_is_told_by_how_much():
    """Both learners in every round, but one pushes seconds after the other (a restart put it
    behind): the late one hears its lag, unless it is jitter, there is no overlap, or the two
    step at different paces (different periods never line up)."""
    first = Arrival(worker_id="a", tokens=100, steps=10, arrived_at=10.0, base_version=3, step_time_s=0.3)
    # τ = 10 steps of 0.3 s: lags over 1.5 s count
    assert late_in_round_by(14.4, first, 0.3, 10) == pytest.approx(2.2)  # half: both may move
    assert late_in_round_by(11.0, first, 0.3, 10) == 0.0  # jitter
    assert late_in_round_by(14.4, first, 0.3, 0) == 0.0  # synchronous: no overlap
    assert late_in_round_by(14.4, first, 0.9, 10) == 0.0  # a learner 3x slower
    assert late_in_round_by(14.4, None, 0.3, 10) == 0.0


GRACE = sync_config(quorum=1, grace_factor=0.5, overlap_steps=10)


def test_grace_window_keeps_round_open_until_quorum_plus_window():
    # K = 1, first push at 2 is the quorum: slack = 10 steps * 1 s - 0 s - 0 s = 10 s;
    # window = 0.5 * 10 = 5 s -> close at 7.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=1.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(7.0)
    assert not decide_close(state, 6.99, GRACE, LIVE3, step_time_s=1.0).close
    d = decide_close(state, 7.0, GRACE, LIVE3, step_time_s=1.0)
    assert d.close
    assert d.recheck_at is None


def test_grace_window_shrinks_with_sync_time():
    # slack = 10*1 - 0 - 4 = 6; window = 3 -> close at 5.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=1.0, sync_time_s=4.0)
    assert d.recheck_at == pytest.approx(5.0)


def test_grace_window_spends_what_reaching_quorum_left():
    # K = 2: first push at 1, quorum at 3 -> time to quorum 2 s; slack = 10 - 2 = 8; window 4 -> close at 7.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 2.0)])
    assert decide_close(state, 2.5, policy, LIVE3, step_time_s=1.0).reason.startswith("1/2")
    state.arrivals.append(arrival("b", 3.0))
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(7.0)


def test_grace_window_uses_the_first_pushers_step_time():
    # The first pusher steps at 0.2 s: 10 steps of overlap = 2 s of slack, window 1 s, whatever the fallback.
    first = Arrival(worker_id="a", tokens=10, steps=1, arrived_at=2.0, base_version=0, step_time_s=0.2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[first])
    assert decide_close(state, 2.0, GRACE, LIVE3, step_time_s=5.0).recheck_at == pytest.approx(3.0)


def test_every_live_learner_pushed_closes_inside_grace_window():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    assert not decide_close(state, 2.5, GRACE, LIVE3, step_time_s=1.0).close
    state.arrivals += [arrival("b", 2.6), arrival("c", 2.7)]
    assert decide_close(state, 2.7, GRACE, LIVE3, step_time_s=1.0).close


def test_no_grace_window_without_factor_or_overlap():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    for policy in (
        sync_config(quorum=1, grace_factor=0.0, overlap_steps=10),
        sync_config(quorum=1, grace_factor=1.0),
    ):
        assert decide_close(state, 2.0, policy, LIVE3, step_time_s=1.0).close


def test_dead_learner_is_not_waited_for():
    # "c" was in the run but is no longer live: a synchronous round closes with a and b.
    policy = sync_config(quorum=0)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("b", 2.0)])
    assert not decide_close(state, 2.0, policy, LIVE3).close
    assert decide_close(state, 2.0, policy, {"a", "b"}).close


def test_push_from_learner_that_died_still_counts_for_quorum():
    # a pushed, then died; b is the only live one and has not pushed: with K = 1 the round closes.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0)])
    assert decide_close(state, 1.0, sync_config(quorum=1), {"b"}).close


def test_empty_round_never_closes():
    state = RoundState(fragment=0, version=0, opened_at=0.0)
    for policy in (sync_config(quorum=1), sync_config(quorum=0), GRACE):
        for live in (set(), LIVE3):
            d = decide_close(state, 1e9, policy, live, step_time_s=1.0)
            assert not d.close
            assert d.recheck_at is None


@pytest.mark.parametrize(
    ("factor", "overlap", "step", "ttq", "sync"),
    [(1.0, 0, 1.0, 5.0, 0.0), (0.5, 2, 1.0, 10.0, 3.0), (2.0, 1, 0.0, 0.0, 1.0), (0.0, 100, 1.0, 0.0, 0.0)],
)
def test_grace_window_never_negative(factor, overlap, step, ttq, sync):
    w = grace_window(sync_config(grace_factor=factor, overlap_steps=overlap), step, ttq, sync)
    assert w >= 0.0


def test_grace_window_value():
    assert grace_window(sync_config(grace_factor=0.5, overlap_steps=10), 2.0, 4.0, 6.0) == pytest.approx(5.0)


# -- staleness ------------------------------------------------------------------------------------


def test_zero_staleness_refuses_older_base():
    policy = sync_config(max_staleness=0)
    assert staleness_refusal(policy.max_staleness, 5, 5) is None
    reason = staleness_refusal(policy.max_staleness, 4, 5)
    assert reason is not None and "stale" in reason


def test_staleness_within_bound_accepted():
    policy = sync_config(max_staleness=2)
    assert staleness_refusal(policy.max_staleness, 3, 5) is None
    assert staleness_refusal(policy.max_staleness, 4, 5) is None
    assert staleness_refusal(policy.max_staleness, 2, 5) is not None


def test_base_newer_than_current_refused():
    reason = staleness_refusal(10, 6, 5)
    assert reason is not None and "newer" in reason


# -- a straggler's late push ----------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [1, 2, 16])
def test_straggler_late_push_accepted_within_staleness(max_staleness):
    # The round against version 2 closed and produced version 3; the open round is against
    # version 3 (it will produce version 4). A straggler's push based on version 2 arrives now:
    # it is one version stale.
    closed = RoundState(fragment=0, version=2, opened_at=0.0, arrivals=[arrival("a", 1.0, base=2)])
    assert decide_close(closed, 1.0, sync_config(quorum=1), LIVE3).close
    current = closed.version + 1
    policy = sync_config(quorum=1, max_staleness=max_staleness, grace_factor=0.0)
    assert staleness_refusal(policy.max_staleness, 2, current) is None

    late = arrival("b", 5.0, base=2)
    new_round = RoundState(fragment=0, version=current, opened_at=1.0, arrivals=[late])
    d = decide_close(new_round, 5.0, policy, LIVE3, step_time_s=1.0)
    assert d.close
    assert d.recheck_at is None


def test_straggler_late_push_refused_without_staleness():
    policy = sync_config(quorum=1, max_staleness=0)
    reason = staleness_refusal(policy.max_staleness, 2, 3)
    assert reason is not None
    assert "stale" in reason
    assert "2" in reason and "3" in reason


@pytest.mark.parametrize(
    ("base", "current", "max_staleness", "accepted"),
    [
        (2, 4, 1, False),  # two versions behind: one past the bound
        (2, 4, 2, True),
        (0, 16, 16, True),
        (0, 17, 16, False),
        (7, 7, 0, True),
    ],
)
def test_staleness_is_the_version_difference(base, current, max_staleness, accepted):
    reason = staleness_refusal(max_staleness, base, current)
    assert (reason is None) == accepted
    if not accepted:
        assert "stale" in reason


# -- quorum counts distinct learners --------------------------------------------------------------


def test_two_pushes_from_one_worker_do_not_make_quorum_two():
    policy = sync_config(quorum=2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 1.5)])
    d = decide_close(state, 100.0, policy, LIVE3)
    assert not d.close
    assert "1/2" in d.reason
    # Even if "a" is the only learner that ever pushes, repeated pushes never reach K = 2.
    state.arrivals += [arrival("a", float(t)) for t in range(2, 10)]
    assert not decide_close(state, 100.0, policy, LIVE3).close


def test_grace_window_quorum_time_is_needed_th_distinct_learner():
    # K = 2, gamma 0.5, tau 10 steps of 1 s. "a" pushes twice early (1.0, 1.5); "b" first at 4.0.
    # Quorum is reached at 4.0 (time to quorum 3 s), not 1.5: slack 10 - 3 = 7, window 3.5 -> 7.5.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(
        fragment=0,
        version=0,
        opened_at=0.0,
        arrivals=[arrival("a", 1.0), arrival("a", 1.5), arrival("b", 4.0)],
    )
    d = decide_close(state, 4.0, policy, LIVE3, step_time_s=1.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(7.5)
    assert not decide_close(state, 7.49, policy, LIVE3, step_time_s=1.0).close
    assert decide_close(state, 7.5, policy, LIVE3, step_time_s=1.0).close


def test_grace_window_quorum_time_uses_each_learners_first_push():
    # a at 1, b at 2, a again at 3: quorum at 2 (b's first), not 3. slack 10 - 1 = 9 -> window 4.5 -> 6.5.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    arrivals = [arrival("a", 1.0), arrival("b", 2.0), arrival("a", 3.0)]
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=arrivals)
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(6.5)
    # The list's order does not matter, only arrival times.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=arrivals[::-1])
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(6.5)


# -- the step time the grace window uses ----------------------------------------------------------


def timed(worker, at, step_time_s):
    return Arrival(
        worker_id=worker, tokens=10, steps=1, arrived_at=at, base_version=0, step_time_s=step_time_s
    )


def test_grace_window_uses_first_pushers_step_time_not_a_later_ones():
    # K = 2; first pusher a (0.5 s/step) at 1, b (3 s/step) at 2. slack = 10*0.5 - 1 = 4 -> window 2 -> 4.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(
        fragment=0, version=0, opened_at=0.0, arrivals=[timed("b", 2.0, 3.0), timed("a", 1.0, 0.5)]
    )
    assert decide_close(state, 2.0, policy, LIVE3, step_time_s=7.0).recheck_at == pytest.approx(4.0)


def test_grace_window_falls_back_to_argument_when_arrival_step_time_zero():
    # The first pusher reports no step time: the argument (2 s) is used. slack 10*2 = 20 -> window 10 -> 12.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[timed("a", 2.0, 0.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=2.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(12.0)
    # ... even if a later pusher reports one.
    state.arrivals.append(timed("b", 3.0, 0.1))
    assert decide_close(state, 3.0, GRACE, LIVE3, step_time_s=2.0).recheck_at == pytest.approx(12.0)
    # Neither known: no window, the round closes at quorum.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[timed("a", 2.0, 0.0)])
    assert decide_close(state, 2.0, GRACE, LIVE3, step_time_s=0.0).close


def test_a_push_that_opens_a_round_is_told_how_late_it_was_for_the_last_one():
    # The previous round's first push came at t = 100 from A; B's push opens the next at 100.6.
    assert missed_round_by(100.6, 100.0, {"A"}, "B", period_s=2.0) == pytest.approx(0.6)


def test_no_miss_for_a_pusher_that_was_in_the_last_round_or_without_one():
    assert missed_round_by(100.6, 100.0, {"A", "B"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(100.6, None, set(), "B", period_s=2.0) == 0.0
    assert missed_round_by(100.6, 100.0, {"A"}, "B", period_s=0.0) == 0.0  # no step time known


def test_a_push_half_a_period_or_more_after_is_early_for_the_next_round_not_late():
    assert missed_round_by(101.0, 100.0, {"A"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(101.5, 100.0, {"A"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(100.99, 100.0, {"A"}, "B", period_s=2.0) == pytest.approx(0.99)


def test_a_short_overlap_keeps_the_grace_windows_gathering_slack():
    """τ = 2 applies merges sooner, but the window still spends grace_steps of the first pusher's
    steps gathering a round; a larger τ widens it, and τ = 0 (synchronous) has none."""
    assert SyncConfig(overlap_steps=2, grace_steps=10).gather_steps == 10
    assert SyncConfig(overlap_steps=20, grace_steps=10).gather_steps == 20
    assert SyncConfig(overlap_steps=0, grace_steps=10).gather_steps == 0
    short = sync_config(grace_factor=1.0, overlap_steps=2, grace_steps=10)
    assert grace_window(short, 0.5, 1.0, 0.5) == pytest.approx(3.5)  # 10 steps of 0.5 s, less 1.5 s
    first = Arrival(worker_id="a", tokens=10, steps=10, arrived_at=0.0, base_version=0, step_time_s=1.0)
    assert late_in_round_by(2.0, first, 1.0, short.gather_steps) == 0.0  # 2 s of 10 s slack: jitter
    assert late_in_round_by(6.0, first, 1.0, short.gather_steps) == pytest.approx(3.0)
