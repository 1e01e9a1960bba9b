"""The watch of each learner's pushes (coordinator/pusher_watch.py): pure judgements on figures and
moved timestamps, and the cosine on real tensors."""

from __future__ import annotations

import random

import pytest
import torch

from diloco.coordinator.delta_sample import alignment
from diloco.coordinator.pusher_watch import (
    MIN_LOSSES,
    MIN_WATCHED,
    RELEASE,
    SUSPECT_LOSS,
    SUSPECT_RATIO,
    WATCH_PUSHES,
    Judgement,
    PusherWatch,
    judge,
    restored,
)


def watched(
    ratio: float | None, cosine: float | None, pushes: int = WATCH_PUSHES, at: float = 100.0
) -> PusherWatch:
    watch = PusherWatch()
    for _ in range(pushes):
        watch.add(at, ratio, cosine)
    return watch


def test_a_learner_pushing_far_larger_deltas_than_the_others_is_named_with_its_figures() -> None:
    watches = {"a": watched(1.0, 0.6), "b": watched(0.9, 0.6), "evil": watched(9.9, 0.6)}
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert got["a"].reason == got["b"].reason == ""
    assert "9.9× the other workers'" in got["evil"].reason


def test_direction_is_judged_against_the_other_learners_not_the_momentum_alone() -> None:
    # Measured (outer_sim --hostile 2 --attack-scale 2.9): the attacker takes the momentum with
    # it, so the honest learners' deltas point against it and the attacker's along it.
    watches = {"a": watched(0.9, -0.3), "b": watched(0.95, -0.23), "evil": watched(2.9, 0.3)}
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert got["a"].reason == got["b"].reason == "", got
    assert "does not go their way" in got["evil"].reason and got["evil"].gap == pytest.approx(0.3 - (-0.23))
    # ... and the plain case: the momentum follows the honest two, the attacker points against it.
    watches = {"a": watched(0.9, 0.63), "b": watched(0.9, 0.63), "evil": watched(1.0, -0.63)}
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert [w for w, j in got.items() if j.reason] == ["evil"]


def by_fragment(figures: list[tuple[float, float]]) -> PusherWatch:
    """A watch of WATCH_PUSHES pushes of each fragment, at (norm ratio, cosine) each."""
    watch = PusherWatch()
    for _ in range(WATCH_PUSHES):
        for fragment, (ratio, cosine) in enumerate(figures):
            watch.add(100.0, ratio, cosine, fragment)
    return watch


def test_a_learner_standing_out_in_one_fragment_only_is_named_by_that_fragment() -> None:
    # Measured (benchmarks/hostile_learner.py): a learner climbing the loss took fragment 0's
    # momentum with it (cosine +0.9 against the others' +0.4) while its fragment 1 looked like
    # theirs; over both fragments together it stood 0.15 from the others, under the bar.
    watches = {
        "a": by_fragment([(1.0, 0.4), (1.0, 0.0)]),
        "b": by_fragment([(1.0, 0.45), (1.0, 0.05)]),
        "odd": by_fragment([(1.0, 0.9), (1.0, -0.1)]),
    }
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert [w for w, j in got.items() if j.reason] == ["odd"], got
    assert "fragment 0's outer momentum is +0.90" in got["odd"].reason
    assert got["odd"].gap == pytest.approx(0.45) and got["a"].gap == pytest.approx(-0.05)
    # Norms are judged over all its pushes only: an honest digits CNN learner's smaller fragment
    # stood at 2.19x the others' (results/pusher_watch_loss_honest.json).
    watches["big"] = by_fragment([(1.2, 0.4), (2.2, 0.0)])
    assert judge(watches, now=100.0, live_within_s=60.0)["big"].reason == ""
    assert watches["big"].figures()["delta_norm_ratio"] == 1.7


def test_a_fragment_is_judged_by_direction_only_among_three_learners_that_push_it() -> None:
    # Fragment 1 pushed by two learners only: which of them is the odd one there, nothing says.
    watches = {
        "a": by_fragment([(1.0, 0.4), (1.0, 0.2)]),
        "b": by_fragment([(1.0, 0.5), (1.0, -0.2)]),
        "c": by_fragment([(1.0, 0.45)]),
    }
    assert all(j.reason == "" for j in judge(watches, now=100.0, live_within_s=60.0).values())
    # A third learner pushes it too, the way the first does: now the second is the odd one there.
    watches["c"] = by_fragment([(1.0, 0.45), (1.0, 0.2)])
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert [w for w, j in got.items() if j.reason] == ["b"] and "fragment 1's" in got["b"].reason


def test_a_learner_odd_in_every_fragment_is_named_over_all_its_pushes_first() -> None:
    # Over all fragments together the figures fill twice as fast with two fragments: a delta
    # reversed whole is named after MIN_WATCHED pushes, not MIN_WATCHED of each fragment.
    watches = {w: by_fragment([(1.0, 0.6), (1.0, 0.6)]) for w in ("a", "b")}
    watches["evil"] = PusherWatch()
    for i in range(MIN_WATCHED):
        watches["evil"].add(100.0, 1.0, -0.6, i % 2)
    got = judge(watches, now=100.0, live_within_s=60.0)["evil"]
    assert "cosine to the fragments' outer momentum is -0.60" in got.reason


def losing(loss: float | None, pushes: int = WATCH_PUSHES) -> PusherWatch:
    watch = PusherWatch()
    for _ in range(pushes):
        watch.add(100.0, 1.0, None, 0, loss)
    return watch


def test_a_learner_reporting_a_loss_far_above_the_others_is_named_even_among_two() -> None:
    # Measured (benchmarks/hostile_learner.py): a learner climbing the loss reported 9 to 38
    # against the honest ones' 2.3 to 3.4 from its first pushes on, the run's first loss 4.9. The
    # higher loss is the broken one, so two learners are enough to judge it.
    got = judge({"a": losing(3.0), "climber": losing(9.0)}, 100.0, 60.0, loss_scale=5.0)
    assert got["a"].reason == "" and got["a"].loss_excess == pytest.approx(-1.2)
    assert "training loss of its last pushes is 9, the other learners' 3: 1.20 of the run's first loss 5" in (
        got["climber"].reason
    )
    # Doing better than the others is no reason; near them neither; 0 turns the rule off, and
    # without a first loss to measure on (no merge yet) nothing is judged.
    got = judge({"a": losing(3.0), "b": losing(1.0), "c": losing(4.4)}, 100.0, 60.0, loss_scale=5.0)
    assert all(j.reason == "" for j in got.values()), got
    assert (
        judge({"a": losing(3.0), "c": losing(9.0)}, 100.0, 60.0, loss_bar=0.0, loss_scale=5.0)["c"].reason
        == ""
    )
    assert judge({"a": losing(3.0), "c": losing(9.0)}, 100.0, 60.0)["c"].loss_excess is None


def test_a_loss_is_measured_on_the_runs_first_loss_not_as_a_ratio() -> None:
    # A classifier near its end: 0.008 against 0.001 is 8x, and nothing (the first loss 2.3).
    got = judge({"a": losing(0.001), "b": losing(0.008)}, 100.0, 60.0, loss_scale=2.3)
    assert all(j.reason == "" for j in got.values()) and got["b"].loss_excess == pytest.approx(0.007 / 2.3)
    got = judge({"a": losing(3.0), "new": losing(30.0, MIN_LOSSES - 1)}, 100.0, 60.0, loss_scale=5.0)
    assert got["new"] == Judgement("", None, None)
    watch = losing(3.0)
    watch.take(Judgement("", None, 0.4))
    watch.take(Judgement("", None, -0.1))
    assert watch.figures()["loss_excess"] == -0.1 and watch.figures()["loss_excess_highest"] == 0.4


def test_honest_learners_whose_cosines_differ_a_little_are_not_named() -> None:
    watches = {"a": watched(1.2, 0.55), "b": watched(0.8, 0.7), "c": watched(1.0, 0.35)}
    assert all(j.reason == "" for j in judge(watches, now=100.0, live_within_s=60.0).values())


def test_with_two_learners_no_direction_is_judged() -> None:
    # Which of two is the odd one? Nothing says: only norms are judged.
    got = judge({"a": watched(1.0, 0.6), "b": watched(1.0, -0.6)}, now=100.0, live_within_s=60.0)
    assert all(j.reason == "" and j.gap is None for j in got.values())


def test_too_few_pushes_say_nothing_yet() -> None:
    watches = {
        "a": watched(1.0, 0.6),
        "b": watched(1.0, 0.6),
        "new": watched(9.9, -0.9, pushes=MIN_WATCHED - 1),
    }
    got = judge(watches, now=100.0, live_within_s=60.0)
    assert got["new"] == Judgement("", None)
    watches["new"].add(100.0, 9.9, -0.9)  # the MIN_WATCHED-th
    assert "9.9×" in judge(watches, now=100.0, live_within_s=60.0)["new"].reason


def test_learners_gone_quiet_are_neither_judged_nor_the_reference() -> None:
    # Two learners that pushed long ago (another phase of training, other cosines) do not make a
    # live one the odd one out, and are not judged themselves.
    watches = {"old1": watched(1.0, -0.5, at=0.0), "old2": watched(1.0, -0.5, at=0.0),
               "a": watched(1.0, 0.6, at=500.0), "b": watched(1.0, 0.6, at=500.0)}  # fmt: skip
    got = judge(watches, now=500.0, live_within_s=60.0)
    assert set(got) == {"a", "b"} and all(j.reason == "" for j in got.values())


def test_figures_keep_the_nearest_each_learner_came_to_the_bar() -> None:
    watch = watched(1.0, 0.5, pushes=MIN_WATCHED)
    for _ in range(WATCH_PUSHES):
        watch.add(101.0, 2.5, 0.5)
    for _ in range(WATCH_PUSHES):
        watch.add(102.0, 0.5, None)  # a push whose cosine is unknown (no merge yet) keeps the last
    figures = watch.figures()
    assert figures["delta_norm_ratio"] == 0.5 and figures["delta_norm_ratio_highest"] == 2.5
    assert figures["delta_alignment"] == 0.5


def test_the_cosine_is_over_the_deltas_tensors_less_running_statistics() -> None:
    momentum = {
        "w": torch.tensor([1.0, 0.0]),
        "b": torch.tensor([0.0, 2.0]),
        "bn.running_mean": torch.zeros(2),
    }
    delta = {
        "w": torch.tensor([2.0, 0.0]),
        "b": torch.tensor([0.0, -2.0]),
        "bn.running_mean": torch.ones(2) * 9,
    }
    # (2·1 + (-2)·2) / (√8 · √5)
    assert alignment(delta, momentum, skip={"bn.running_mean"}) == pytest.approx(-2 / (8**0.5 * 5**0.5))
    assert alignment(delta, {n: torch.zeros(2) for n in momentum}) is None  # no merge yet
    assert alignment({"w": torch.tensor([float("inf"), 0.0])}, momentum) is None


def test_the_cosine_of_large_tensors_is_read_from_a_sample_that_moves_push_by_push() -> None:
    g = torch.Generator().manual_seed(0)
    way = {"w": torch.randn(1_000_000, generator=g), "b": torch.randn(300, generator=g)}
    momentum = {n: t + torch.randn(t.shape, generator=g) for n, t in way.items()}
    delta = {n: -t + 2 * torch.randn(t.shape, generator=g) for n, t in way.items()}
    full = (
        sum(float(delta[n] @ momentum[n]) for n in way)
        / (sum(float(t @ t) for t in delta.values()) * sum(float(t @ t) for t in momentum.values())) ** 0.5
    )
    sampled = [alignment(delta, momentum, rng=random.Random(seed)) for seed in range(5)]
    assert all(c == pytest.approx(full, abs=0.01) for c in sampled), (full, sampled)
    assert len(set(sampled)) > 1  # other blocks each push: a pusher cannot aim at the sample


def test_a_judgement_taken_says_when_a_learner_comes_to_look_suspect_and_when_it_stops() -> None:
    watch = watched(1.0, 0.6)
    assert not watch.take(Judgement("", 0.1)) and watch.largest_gap == 0.1
    assert watch.take(Judgement("odd", -0.5)) and watch.suspect == "odd" and watch.largest_gap == 0.5
    assert not watch.take(Judgement("odd, other figures", 0.2)) and watch.largest_gap == 0.5
    assert watch.take(Judgement("", None)) and watch.suspect == ""


def test_a_named_learner_is_judged_on_its_pushes_since_against_the_release_share_of_the_bar() -> None:
    # Measured: a climber first named just over the loss bar was un-named and named push by push,
    # its pushes merged between (in CI one such run ended near the unigram baseline); a liar named
    # by its direction looked ordinary again over a mix of its pushes before and after (its old
    # ones had taken the momentum its way). Once named, a learner stays named for MIN_WATCHED
    # pushes, then is judged on its pushes since against RELEASE x each bar; an honest one named by
    # mistake comes back. Status keeps showing the figures of all its last pushes.
    def judged(watches: dict[str, PusherWatch]) -> dict[str, str]:
        got = judge(watches, now=100.0, live_within_s=60.0, loss_scale=1.0)
        for worker, judgement in got.items():
            watches[worker].take(judgement)
        return {w: j.reason for w, j in got.items() if j.reason}

    def push(watch: PusherWatch, times: int, ratio: float = 1.0, loss: float | None = None) -> None:
        for _ in range(times):
            watch.add(100.0, ratio, 0.6, 0, loss)

    between = (RELEASE + 1) / 2  # below the bar, above its release share
    losses = {"a": losing(1.0), "b": losing(1.0 + SUSPECT_LOSS * between)}
    assert judged(losses) == {}  # never named: the bar itself
    losses["b"] = losing(1.0 + SUSPECT_LOSS * 1.05)
    reason = judged(losses)["b"]
    push(losses["b"], MIN_WATCHED - 1, loss=1.0)  # looking fine, but too few pushes to tell
    assert judged(losses) == {"b": reason}
    assert losses["b"].figures()["loss_excess"] == 0.0  # its pushes since, as judged
    push(losses["b"], 1, loss=1.0)
    assert judged(losses) == {} and not losses["b"].suspect  # its 6 since look like the others'
    losses["b"] = losing(1.0 + SUSPECT_LOSS * 1.05)
    judged(losses)
    push(losses["b"], MIN_WATCHED, loss=1.0 + SUSPECT_LOSS * between)
    assert "above %g" % (SUSPECT_LOSS * RELEASE) in judged(losses)["b"]  # still named, judged again
    push(losses["b"], WATCH_PUSHES, loss=1.0 + SUSPECT_LOSS * RELEASE * 0.9)
    assert judged(losses) == {} and not losses["b"].suspect  # back
    # Norms (and directions) alike; status shows the median of all its last pushes meanwhile.
    norms = {"a": watched(1.0, 0.6), "b": watched(1.0, 0.6), "big": watched(SUSPECT_RATIO * 1.1, 0.6)}
    assert set(judged(norms)) == {"big"}
    push(norms["big"], MIN_WATCHED, ratio=SUSPECT_RATIO * between)
    assert set(judged(norms)) == {"big"}
    assert norms["big"].figures()["delta_norm_ratio"] == pytest.approx(SUSPECT_RATIO * 1.1)
    push(norms["big"], WATCH_PUSHES, ratio=SUSPECT_RATIO * RELEASE * 0.9)
    assert judged(norms) == {}


def test_a_learner_named_when_the_coordinator_stopped_stays_named_and_is_judged_on_its_next_pushes() -> None:
    # Its loss excess between the release share and the bar: a restart that judged it afresh at
    # the bar would un-name it, and merge its pushes until it climbed past the bar again.
    between = 1.0 + SUSPECT_LOSS * (RELEASE + 1) / 2
    history = {w: [(90.0, None, None, 0, loss)] * WATCH_PUSHES for w, loss in (("a", 1.0), ("b", between))}
    assert not any(w.suspect for w in restored(history, 100.0, 60.0, loss_scale=1.0).values())
    refusal = "its learner looks hostile or broken (sync.refuse_suspects): its training loss ..."
    again = restored(history, 100.0, 60.0, loss_scale=1.0, named={"b": refusal})
    assert not again["a"].suspect and again["b"].suspect == "its training loss ..."
    for _ in range(MIN_WATCHED):
        again["b"].add(100.0, None, None, 0, between)
    got = judge(again, 100.0, 60.0, loss_scale=1.0)
    assert "above %g" % (SUSPECT_LOSS * RELEASE) in got["b"].reason
    # Named, but gone quiet: not judged, it stays named until its next push is.
    assert restored(history, 1000.0, 60.0, loss_scale=1.0, named={"b": refusal})["b"].suspect


def test_each_bar_is_the_config_s_and_a_bar_of_zero_turns_its_rule_off() -> None:
    # One learner too large, another pointing the other way: each named by its own rule only.
    watches = {
        "a": watched(1.0, 0.6),
        "b": watched(1.0, 0.6),
        "big": watched(3.0, 0.6),
        "odd": watched(1.0, -0.6),
    }

    def named(**bars: float) -> dict[str, str]:
        got = judge(watches, now=100.0, live_within_s=60.0, **bars)
        return {w: j.reason for w, j in got.items() if j.reason}

    assert set(named()) == {"big", "odd"}
    assert set(named(ratio_bar=0.0)) == {"odd"}
    assert set(named(gap_bar=0.0)) == {"big"}
    assert named(ratio_bar=0.0, gap_bar=0.0) == {}
    assert set(named(ratio_bar=4.0, gap_bar=1.5)) == set()
    assert "above 2.5×" in named(ratio_bar=2.5)["big"]


def test_a_restored_watch_names_the_live_at_once_and_the_rest_at_their_next_push() -> None:
    def pushes(cosine: float, at: float) -> list[tuple[float, float | None, float | None, int, float | None]]:
        return [(at, 1.0, cosine, 0, None)] * WATCH_PUSHES

    history = {"a": pushes(0.6, 90.0), "b": pushes(0.55, 90.0), "evil": pushes(-0.6, 90.0)}
    soon = restored(history, now=100.0, live_within_s=60.0)
    assert [w for w, watch in soon.items() if watch.suspect] == ["evil"]
    assert soon["evil"].largest_gap == pytest.approx(1.15)
    # After a long stop nobody is live, and nobody is named; as they push again, at once.
    later = restored(history, now=1000.0, live_within_s=60.0)
    assert not any(watch.suspect for watch in later.values())
    for worker, cosine in (("a", 0.6), ("b", 0.55), ("evil", -0.6)):
        later[worker].add(1000.0, 1.0, cosine)
    got = judge(later, now=1000.0, live_within_s=60.0)
    assert [w for w, j in got.items() if j.reason] == ["evil"]
