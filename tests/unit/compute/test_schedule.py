"""The learner's schedule: which fragment is pushed when, when a merge applies, mixing, blocking."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.compute import schedule
from diloco.compute.held import HeldFragment
from diloco.compute.inner import straggle_s
from diloco.compute.schedule import (
    apply_due,
    catch_up_steps,
    fragment_due,
    mix,
    must_block,
    push_interval,
    share_done,
    token_share,
)
from diloco.config import RunConfig


def pushes(first: int, last: int, inner_steps: int, fragments: int) -> dict[int, int]:
    """{step: fragment} for every push in steps first..last (inclusive)."""
    out = {}
    for step in range(first, last + 1):
        p = fragment_due(step, inner_steps, fragments)
        if p is not None:
            out[step] = p
    return out


# -- push_interval and fragment_due ---------------------------------------------------------------


def test_two_fragments_alternate_every_half_period():
    assert push_interval(50, 2) == 25
    assert pushes(1, 100, 50, 2) == {25: 0, 50: 1, 75: 0, 100: 1}


def test_two_fragments_each_pushed_every_h_steps():
    got = pushes(1, 500, 50, 2)
    for frag in (0, 1):
        steps = [s for s, p in got.items() if p == frag]
        assert len(steps) == 10
        assert all(b - a == 50 for a, b in zip(steps, steps[1:], strict=False))


@pytest.mark.parametrize("inner_steps", [1, 7, 50, 500])
def test_one_fragment_pushed_every_h_steps(inner_steps):
    assert push_interval(inner_steps, 1) == inner_steps
    got = pushes(1, 4 * inner_steps, inner_steps, 1)
    assert got == {k * inner_steps: 0 for k in range(1, 5)}


@pytest.mark.parametrize(("inner_steps", "fragments"), [(1, 2), (3, 8), (4, 5)])
def test_more_fragments_than_steps_gives_interval_one(inner_steps, fragments):
    assert push_interval(inner_steps, fragments) == 1
    # A push after every step, round-robin over all fragments.
    for step in range(1, 3 * fragments + 1):
        assert fragment_due(step, inner_steps, fragments) == (step - 1) % fragments


@pytest.mark.parametrize(("inner_steps", "fragments"), [(50, 2), (50, 1), (1, 1), (3, 8)])
@pytest.mark.parametrize("step", [0, -1, -25, -50, -100])
def test_step_zero_or_negative_never_pushes(step, inner_steps, fragments):
    assert fragment_due(step, inner_steps, fragments) is None


def test_no_push_between_intervals():
    for step in range(1, 25):
        assert fragment_due(step, 50, 2) is None
    for step in range(26, 50):
        assert fragment_due(step, 50, 2) is None


@st.composite
def h_and_p(draw):
    fragments = draw(st.integers(1, 8))
    inner_steps = fragments * draw(st.integers(1, 200 // fragments))
    return inner_steps, fragments


@settings(max_examples=200, deadline=None, derandomize=True)
@given(hp=h_and_p(), start=st.integers(1, 2000))
def test_every_window_of_h_steps_pushes_each_fragment_once(hp, start):
    inner_steps, fragments = hp
    assert 1 <= fragments <= inner_steps <= 200 and inner_steps % fragments == 0
    got = pushes(start, start + inner_steps - 1, inner_steps, fragments)
    assert sorted(got.values()) == list(range(fragments))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(hp=h_and_p())
def test_each_fragment_recurs_exactly_every_h_steps(hp):
    inner_steps, fragments = hp
    got = pushes(1, 3 * inner_steps, inner_steps, fragments)
    assert len(got) == 3 * fragments
    for step, frag in got.items():
        assert 0 <= frag < fragments
        if step + inner_steps <= 3 * inner_steps:
            assert got.get(step + inner_steps) == frag
            # ... and not sooner.
            assert frag not in {got[s] for s in got if step < s < step + inner_steps}


# -- apply_due ------------------------------------------------------------------------------------


def test_apply_due_boundary():
    assert not apply_due(9, 10)
    assert apply_due(10, 10)
    assert apply_due(11, 10)
    assert apply_due(0, 0)
    assert not apply_due(-1, 0)


# -- mix ------------------------------------------------------------------------------------------

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(local=finite, merged=finite)
def test_mix_alpha_zero_overwrites(local, merged):
    assert mix(local, merged, 0.0) == merged


@settings(max_examples=100, deadline=None, derandomize=True)
@given(local=finite, merged=finite)
def test_mix_alpha_half_is_halfway(local, merged):
    assert mix(local, merged, 0.5) == pytest.approx((local + merged) / 2, rel=1e-12, abs=1e-12)


def test_mix_hand_computed():
    assert mix(2.0, 10.0, 0.0) == 10.0
    assert mix(2.0, 10.0, 0.5) == 6.0
    assert mix(2.0, 10.0, 0.25) == pytest.approx(8.0)  # 0.25*2 + 0.75*10


# -- must_block -----------------------------------------------------------------------------------


def test_must_block_only_past_a_positive_bound():
    assert not must_block(0.0, 30.0)
    assert not must_block(29.9, 30.0)
    assert not must_block(30.0, 30.0)  # "longer than" the bound
    assert must_block(30.01, 30.0)
    assert must_block(1e9, 30.0)


@pytest.mark.parametrize("unreachable", [0.0, 1.0, 1e9, float("inf")])
@pytest.mark.parametrize("bound", [0.0, -1.0])
def test_must_block_never_with_bound_zero_or_negative(unreachable, bound):
    assert not must_block(unreachable, bound)


def test_catch_up_moves_the_schedule_by_the_missed_steps_at_most_half_an_interval():
    assert catch_up_steps(0.0, 0.04, 25) == 0
    assert catch_up_steps(0.2, 0.04, 25) == 5  # missed by 5 steps' time
    assert catch_up_steps(2.0, 0.04, 25) == 12  # half of 25 at most, the rest next time
    assert catch_up_steps(0.2, 0.0, 25) == 0  # no step time yet: nothing to convert with


def test_a_token_share_only_for_synchronous_dealt_budgeted_runs():
    cfg = RunConfig().with_overrides(
        {
            "train.max_tokens": 1001,
            "data.deal": 2,
            "sync.overlap_steps": 0,
            "sync.quorum": 0,
            "sync.fragments": 1,
        }
    )
    assert token_share(cfg) == 501  # rounded up: the shares cover the budget
    assert not share_done(500, cfg) and share_done(501, cfg)
    assert token_share(cfg.with_overrides({"data.deal": 0})) == 0
    assert token_share(cfg.with_overrides({"train.max_tokens": 0})) == 0
    decoupled = cfg.with_overrides({"sync.overlap_steps": 10})
    assert token_share(decoupled) == 0 and not share_done(10**9, decoupled)


# -- the end game -------------------------------------------------------------------------------


def held(steps: int = 0, in_flight: bool = False) -> HeldFragment:
    f = HeldFragment(["w"])
    f.steps, f.in_flight = steps, in_flight
    return f


def test_hand_in_pushes_what_holds_steps_and_is_not_in_flight():
    plan = schedule.hand_in([held(5), held(5, in_flight=True), held(0)])
    assert plan.push == [0] and not plan.give_back


def test_hand_in_pushes_the_fragment_pushed_longest_ago_first():
    # Fragment 0 was pushed 2 steps ago, fragment 1 never (7 steps): 1 goes first, as the schedule
    # would have it: it carries every row (test_rows: a hand-in names every row on its first push).
    plan = schedule.hand_in([held(2), held(7), held(2)])
    assert plan.push == [1, 0, 2] and not plan.give_back


def test_hand_in_waits_for_pushes_in_flight_before_giving_rows_back():
    plan = schedule.hand_in([held(0), held(3, in_flight=True)])
    assert plan.push == [] and not plan.give_back and "in flight" in plan.reason


def test_hand_in_gives_rows_back_once_everything_is_pushed_and_merged():
    plan = schedule.hand_in([held(0), held(0)])
    assert plan.push == [] and plan.give_back


def test_a_starved_learner_says_so_once_a_period():
    assert schedule.empty_push_due(now=10.0, last_empty_push=0.0, period_s=2.0)
    assert not schedule.empty_push_due(now=11.9, last_empty_push=10.0, period_s=2.0)
    assert schedule.empty_push_due(now=12.0, last_empty_push=10.0, period_s=2.0)


def test_the_loop_ends_for_the_first_reason_that_holds():
    quiet = {"stopped": False, "finishing": False, "no_more_data": False, "share_done": False}
    assert schedule.loop_end(**quiet) is None
    assert schedule.loop_end(**{**quiet, "share_done": True}) == "token share trained"
    assert schedule.loop_end(**{**quiet, "no_more_data": True, "share_done": True}) == "no more data"
    assert schedule.loop_end(**{**quiet, "finishing": True, "no_more_data": True}) == "run finishing"
    assert schedule.loop_end(**{**quiet, "stopped": True, "finishing": True}) == "stopped"


def test_a_straggler_sleeps_in_proportion_to_its_step():
    assert straggle_s(0.2, slow_factor=3.0, step_delay_s=0.0) == pytest.approx(0.4)
    assert straggle_s(0.2, slow_factor=1.0, step_delay_s=0.05) == 0.05
    assert straggle_s(0.2, slow_factor=1.0, step_delay_s=0.0) == 0.0


def test_a_learner_steps_while_any_of_its_allowance_is_left():
    assert not schedule.budget_spent(10_000, None)  # no budget: never spent
    assert not schedule.budget_spent(1_500, (1_000, 600))
    assert schedule.budget_spent(1_600, (1_000, 600))
    assert schedule.budget_spent(1_000, (1_000, 0))  # hand in and wait
