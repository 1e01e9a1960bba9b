"""The centered clip's pure parts (coordinator/centered_clip.py): a delta's deviation from the
fragment's mean step from what the push already measured, the share of it kept against the other
workers' recent deviations, and the pull toward the mean step."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.coordinator.centered_clip import deviation, kept_share, pull_toward


def test_the_deviation_from_norms_and_cosine_is_the_distance_between_the_two() -> None:
    g = torch.Generator().manual_seed(0)
    delta, mean_step = torch.randn(1000, generator=g), torch.randn(1000, generator=g) * 0.3 + 0.1
    cosine = float(delta @ mean_step / (delta.norm() * mean_step.norm()))
    got = deviation(float(delta @ delta), float(mean_step.norm()), cosine)
    assert got == pytest.approx(float((delta - mean_step).norm()), rel=1e-5)
    # No momentum yet (or no cosine known): the deviation is the delta's norm.
    assert deviation(4.0, 0.0, None) == 2.0 and deviation(4.0, 3.0, None) == 2.0
    # Rounding cannot make it the root of a negative.
    assert deviation(1.0, 1.0, 1.0 + 1e-12) == pytest.approx(0.0, abs=1e-5)


def test_a_deviation_within_the_bound_is_kept_whole_and_one_beyond_it_down_to_the_bound() -> None:
    recent, by = (1.0, 1.2, 0.8, 1.0, 1.1), ("a", "b", "a", "b", "a")
    assert kept_share(1.9, recent, by, "c", 2.0) == (1.0, "")
    share, why = kept_share(5.0, recent, by, "c", 2.0)
    assert share == pytest.approx(2.0 * 1.0 / 5.0)
    assert "5.0× the median of the last 5" in why and "sync.center_clip = 2" in why and "40%" in why


def test_the_median_is_the_other_workers_where_they_are_enough() -> None:
    # The pusher's own large deviations cannot raise its bar: the other workers' median is 1.
    recent = (1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0)
    by = ("a", "a", "a", "a", "h", "h", "h", "h", "h")
    share, _ = kept_share(9.0, recent, by, "h", 2.0)
    assert share == pytest.approx(2.0 / 9.0)
    # Too few of the others': everyone's median.
    assert kept_share(9.0, recent[3:], by[3:], "h", 2.0)[0] == 1.0


@pytest.mark.parametrize(
    "recent, bound", [((1.0, 1.0, 1.0), 2.0), ((1.0,) * 8, 0.0), ((0.0,) * 8, 2.0)],
    ids=["short history", "off", "zero median"],
)  # fmt: skip
def test_nothing_is_clipped_without_a_history_a_bound_or_a_median(recent, bound) -> None:
    assert kept_share(50.0, recent, ("a",) * len(recent), "h", bound) == (1.0, "")


def test_the_pull_keeps_the_share_of_the_deviation_and_leaves_statistics_alone() -> None:
    g = torch.Generator().manual_seed(1)
    delta = {"w": torch.randn(64, generator=g), "bn.running_mean": torch.randn(8, generator=g)}
    momentum = {"w": torch.randn(64, generator=g), "bn.running_mean": torch.randn(8, generator=g)}
    mu, share = 0.9, 0.25
    before = {n: t.clone() for n, t in delta.items()}
    pull_toward(delta, momentum, mu, share, skip={"bn.running_mean"})
    mean_step = (1 - mu) * momentum["w"]
    assert torch.allclose(delta["w"], mean_step + share * (before["w"] - mean_step), atol=1e-6)
    assert torch.equal(delta["bn.running_mean"], before["bn.running_mean"])
    # Its deviation after the pull is the kept share of the one before.
    after = float((delta["w"] - mean_step).norm())
    assert after == pytest.approx(share * float((before["w"] - mean_step).norm()), rel=1e-5)
    assert math.isfinite(after)
