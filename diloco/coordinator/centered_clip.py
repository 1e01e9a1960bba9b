"""Centered clipping of a push (sync.center_clip): how far a delta stands from where the fragment
has been going, and the pull that brings one standing too far back to the bound, as pure functions.

A norm bound limits how far one push moves the model, not where to: a learner that pushes its
delta reversed at 9.9× the median (under the outlier bar of 10×) took outer_sim's eval from 2.42
to 22 in 20 merges, and to 2.93 with the pusher watch refusing it after its 8th push. Where the
fragment has been going is its outer momentum m, whose mean step is (1 − μ)·m (m sums the steps
with decay μ). A delta's deviation from it, ‖Δ − (1 − μ)·m‖, is what a push says that the
fragment's history does not; one whose deviation stands above K × the other workers' median is
taken as (1 − μ)·m + (Δ − (1 − μ)·m)·K·median/deviation: its own direction kept, its say bounded.
An honest push seldom stands there (the others' deviations are the same kind of quantity); a
reversed push stands at about its scale + 1. After Karimireddy, He and Jaggi, "Learning from
History for Byzantine Robust Optimization" (ICML 2021), with the outer momentum as the centre.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch

from diloco.coordinator import limits


def deviation(sq_norm: float, mean_step_norm: float, cosine: float | None) -> float:
    """‖Δ − r‖ from ‖Δ‖², ‖r‖ and the cosine between Δ and r (None: r is zero, or not known):
    what the push already measured (its norm, the pusher watch's sampled cosine), no pass more."""
    if cosine is None or mean_step_norm <= 0:
        return math.sqrt(max(0.0, sq_norm))
    norm = math.sqrt(max(0.0, sq_norm))
    return math.sqrt(max(0.0, sq_norm + mean_step_norm**2 - 2.0 * cosine * norm * mean_step_norm))


def kept_share(
    deviation_per_h: float,
    recent: Sequence[float],
    by: Sequence[str],
    worker_id: str,
    bound: float,
) -> tuple[float, str]:
    """How much of a push's deviation is kept (1: all, the push as it came) and why less: above
    `bound` × the median of the fragment's recent deviations (other workers' where they are
    enough, so a pusher cannot raise its own bar), it keeps bound × median of it. 0 or too short
    a history: 1."""
    reference = limits.norm_reference(recent, by, worker_id)
    if bound <= 0 or reference is None or reference[0] <= 0:
        return 1.0, ""
    median, count = reference
    if deviation_per_h <= bound * median:
        return 1.0, ""
    share = bound * median / deviation_per_h
    return share, (
        f"its deviation from the fragment's mean step is {deviation_per_h / median:.1f}× the median of the "
        f"last {count} (sync.center_clip = {bound:g}): {share:.0%} of it kept"
    )


def pull_toward(
    delta: dict[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    mu: float,
    share: float,
    skip: Collection[str] = (),
) -> None:
    """Δ ← r + share·(Δ − r), r = (1 − μ)·m, in place, over the tensors but `skip` (running
    statistics come as values, not steps)."""
    for name, value in delta.items():
        if name in skip or name not in momentum:
            continue
        value.mul_(share).add_(momentum[name].to(value.dtype), alpha=(1.0 - mu) * (1.0 - share))
