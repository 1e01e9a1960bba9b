"""The run's life and the publisher's pacing: pure decisions, tested by moving numbers, never by sleeping."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.lifecycle import (
    FINISHED,
    FINISHING,
    RUNNING,
    Claim,
    may_enter,
    next_run_state,
    training_allowance,
)
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


def test_a_run_whose_training_data_is_exhausted_finishes_on_its_own():
    """Started role by role, with no budget: every shard's rows merged, nothing more to lease."""
    assert state_after(RUNNING, budget=0, data_exhausted=False).state is None
    change = state_after(RUNNING, budget=0, data_exhausted=True)
    assert change.state == FINISHING and "exhausted" in change.reason
    assert state_after(RUNNING, tokens_merged=1000, data_exhausted=True).reason.startswith("token budget")
    # Then as any finishing run: its learners leave (they were told "no more data"), its merges publish.
    assert state_after(FINISHING, data_exhausted=True).state is None
    assert state_after(FINISHING, live_learners=0, data_exhausted=True).state == FINISHED
    assert state_after(FINISHED, live_learners=0, data_exhausted=True).state is None


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


# -- a Decoupled run's token budget: each learner's allowance --------------------------------------


def test_what_is_left_to_train_is_split_evenly_and_the_last_tokens_go_whole():
    others = [Claim(unmerged=100, allowed=200)]
    # 500 left once both learners' unmerged work is counted: half is mine (the other's 200 is
    # within its half).
    assert training_allowance(budget=1000, tokens_merged=300, mine=100, others=others) == 250
    assert training_allowance(budget=1000, tokens_merged=699, mine=0, others=others) == 1
    assert training_allowance(budget=1000, tokens_merged=700, mine=0, others=others) == 0
    # Over-claimed (a merge counted by the ledger that the learner has not taken yet): nothing, not less.
    assert training_allowance(budget=1000, tokens_merged=900, mine=500, others=others) == 0


def test_an_allowance_counts_for_what_its_learner_can_train_before_it_reports_again():
    """A large allowance given early (a learner alone at the start) does not lock the budget away
    from a learner that joins later: it counts only for a horizon of its learner's speed."""
    early = [Claim(unmerged=10_000, allowed=230_000, rate=7_500.0)]
    got = training_allowance(budget=240_000, tokens_merged=0, mine=0, others=early, horizon_s=6.0)
    assert got == (240_000 - 10_000) // 2
    unknown = [Claim(unmerged=10_000, allowed=230_000)]  # speed not known yet: all of it counts
    assert training_allowance(budget=240_000, tokens_merged=0, mine=0, others=unknown, horizon_s=6.0) == 0


def test_a_learner_asking_after_the_others_took_theirs_gets_its_whole_share():
    """Measured: a 2-rank learner beside a 3x slower one, asking every 0.5 s once its allowance
    ran out, was given its speed's share of what the slow one's allowance left, not its share of
    what was left to train: a quarter short each time, it ran out mid-run again and again."""
    slow = [Claim(unmerged=10_000, allowed=23_000, rate=8_000.0)]
    got = training_allowance(
        budget=240_000, tokens_merged=110_000, mine=20_000, others=slow, my_rate=27_500.0, horizon_s=6.0
    )
    assert got == 100_000 - 23_000  # its share (77.5k) less the slow one's allowance beyond its own
    # Asking in turn, the slow one gets its share of what is left to train, which the fast one
    # left it: both run out together.
    fast = [Claim(unmerged=20_000, allowed=got, rate=27_500.0)]
    back = training_allowance(
        budget=240_000, tokens_merged=110_000, mine=10_000, others=fast, my_rate=8_000.0, horizon_s=6.0
    )
    assert back == int(100_000 * 8_000 / 35_500)
    assert abs(got / 27_500 - back / 8_000) < 0.05  # seconds apart, at their speeds


def test_a_faster_learner_gets_its_speed_share_so_nobody_waits_on_a_slow_ones_half():
    slow = [Claim(unmerged=0, allowed=0, rate=1000.0)]
    assert training_allowance(budget=4000, tokens_merged=0, mine=0, others=slow, my_rate=3000.0) == 3000
    # A speed not known yet counts as the others' typical speed.
    assert training_allowance(budget=4000, tokens_merged=0, mine=0, others=slow) == 2000


def test_a_claim_reported_a_heartbeat_ago_is_aged_by_what_its_learner_trained_and_merged_since():
    """Measured (seed 14, M = 2, H = 50): one learner's claim, reported 3 s earlier as 34k unmerged
    and a 91k allowance, had since been mostly trained and merged; counted unaged, it left the
    learner asking now 24k while the other still held 48k, so it ran out first and waited."""
    stale = Claim(unmerged=34_056, allowed=90_904, rate=29_000.0, age_s=3.0, merged_since=77_000)
    assert stale.pending == 34_056 + 87_000 - 77_000
    assert stale.untrained(6.0) == 90_904 - 87_000
    got = training_allowance(
        budget=1_228_800,
        tokens_merged=1_032_000,
        mine=47_472,
        others=[stale],
        my_rate=29_000.0,
        horizon_s=6.0,
    )
    left = 1_228_800 - 1_032_000 - 47_472 - stale.pending
    assert got == left // 2  # its even share: the other's allowance left is within its own half
    unaged = Claim(unmerged=34_056, allowed=90_904, rate=29_000.0)
    assert training_allowance(
        budget=1_228_800, tokens_merged=1_032_000, mine=47_472, others=[unaged], my_rate=29_000.0, horizon_s=6.0
    ) == 1_228_800 - 1_032_000 - 47_472 - 34_056 - 90_904  # fmt: skip


def test_however_wrong_the_speed_a_claim_never_counts_less_than_its_report_less_its_merges():
    for rate in (0.0, 10.0, 1e6):
        for merged_since in (0, 50, 500):
            c = Claim(unmerged=100, allowed=300, rate=rate, age_s=2.0, merged_since=merged_since)
            assert c.pending + c.untrained(math.inf) >= 100 + 300 - merged_since


@settings(max_examples=200, deadline=None)
@given(
    learners=st.integers(1, 6),
    batch=st.integers(1, 64),
    budget=st.integers(1, 5000),
    events=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["beat", "step", "merge"])), max_size=400),
    rates=st.lists(st.floats(0.0, 1e5), min_size=6, max_size=6),
)
def test_learners_under_allowances_train_the_budget_and_at_most_a_batch_each_more(
    learners, batch, budget, events, rates
):
    """Heartbeats, steps and merges in any order: what the learners train never passes the budget
    by more than one batch per learner; once every learner is paused and its work merged, the
    merged tokens reach the budget (the run finishes) whatever order things came in. The
    coordinator sees each learner as it last reported, aged by a clock and by the merges of its
    work since (the speeds it ages them by are arbitrary here, as a wrong estimate would be)."""
    trained = [0] * learners
    unmerged = [0] * learners
    allowance = [(0, 0)] * learners  # (trained when reported, allowed past it)
    allowed = [0] * learners
    reported = [0] * learners  # unmerged, as reported at the last heartbeat
    reported_at = [0.0] * learners
    merged_of = [0] * learners  # each learner's tokens merged, and that count at its last report
    merged_of_then = [0] * learners
    merged = 0
    now = 0.0

    def beat(i):
        others = [
            Claim(
                reported[j], allowed[j], rates[j], age_s=now - reported_at[j], merged_since=merged_of[j] - merged_of_then[j]
            )
            for j in range(learners)
            if j != i
        ]  # fmt: skip
        allowed[i] = training_allowance(
            budget=budget, tokens_merged=merged, mine=unmerged[i], others=others, my_rate=rates[i]
        )
        allowance[i] = (trained[i], allowed[i])
        reported[i], reported_at[i], merged_of_then[i] = unmerged[i], now, merged_of[i]

    def step(i):
        if trained[i] - allowance[i][0] < allowance[i][1]:
            trained[i] += batch
            unmerged[i] += batch

    def merge(i):
        nonlocal merged
        merged, merged_of[i], unmerged[i] = merged + unmerged[i], merged_of[i] + unmerged[i], 0

    for who, what in events:
        i = who % learners
        now += 0.01
        if what == "beat":
            beat(i)
        elif what == "step":
            step(i)
        else:  # a learner's work merges (and it learns so)
            merge(i)
        assert sum(trained) <= budget + learners * batch
    for _ in range(budget + 2):  # then the end game: every learner asks, steps, hands in
        for i in range(learners):
            now += 0.01
            beat(i)
            step(i)
            merge(i)
        if merged >= budget:
            break
    assert budget <= merged == sum(trained) <= budget + learners * batch
