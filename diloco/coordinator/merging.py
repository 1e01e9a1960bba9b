"""How a round's pushes become one step of the global model, as pure functions: each delta's
weight (tokens, steps, age), the scales a partial round takes (coverage, work, short pushes), the
weighted sum folded as pushes arrive (MergeAccumulator), and the outer Nesterov step.

The syncer (syncer.py) decides when a round closes; this module decides what it merges into.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def merge_weight(tokens: int, steps: int, mode: str) -> float:
    """One delta's weight before normalising. `token`/`rda`: tokens·(tokens/steps), as in
    Decoupled DiLoCo; `mean`: 1."""
    if mode == "mean":
        return 1.0
    if mode in ("token", "rda"):
        return float(tokens) * (float(tokens) / max(1, steps))
    raise ValueError(f"unknown merge mode {mode!r}")


def age_factor(stale_decay: float, lag: int) -> float:
    """How much of a push based `lag` versions behind the round's enters the outer gradient:
    stale_decay ** lag (1 for a push on the current version; sync.stale_decay).

    A stale push's delta was trained from a point the merges since have moved, so it is an old
    gradient; scaled before it is summed (the round's normaliser keeps its full weight), a round
    holding only stale pushes also steps less, as an age-aware outer optimizer does (CGAD,
    arXiv 2605.09126, scales each pseudo-gradient by exp(-a * age))."""
    return stale_decay ** max(0, lag)


def merge_weights(tokens: Sequence[int], steps: Sequence[int], mode: str) -> list[float]:
    """Normalised weights per delta (merge_weight of each, summing to 1)."""
    raw = [merge_weight(t, s, mode) for t, s in zip(tokens, steps, strict=True)]
    total = sum(raw)
    if total <= 0:
        return [1.0 / len(raw)] * len(raw)
    return [w / total for w in raw]


def coverage_scale(contributors: int, live_learners: int) -> float:
    """The share of the learners whose work is in this merge.

    Merged deltas are a weighted *mean*, so with quorum K < M a round holding one learner's delta
    would move the fragment as far as a round holding all M — and with K = 1 every learner's push
    closes its own round, M outer steps per sync period where synchronous DiLoCo takes one. Scaling
    the outer gradient by contributors / live keeps one period's total step what synchronous DiLoCo
    takes (and leaves it unchanged when everyone is in the round).
    """
    if contributors <= 0:
        return 0.0
    return min(1.0, contributors / max(contributors, live_learners))


def work_fraction(steps: int, live_learners: int, inner_steps: int) -> float:
    """The share of a full outer step a round's work is: its inner steps over what a round of
    every live learner's H steps holds (capped at 1). The outer step's momentum moves the model by
    this share (outer_step's `fraction`).

    The merged delta is a mean, so a round of a few steps already has a small outer gradient; but
    the momentum term μ·m does not shrink with it. Measured (M = 2, H = 100, a token budget): the
    end game closed 9 rounds of 3 to 140 steps, each given a whole momentum step, and the run
    ended at eval 2.51 against its training loss of 2.13 ten rounds in. Restarted learners' first
    pushes and rounds closed early by a grace window are the same case.
    """
    if steps <= 0 or inner_steps <= 0:
        return 0.0
    return min(1.0, steps / (max(1, live_learners) * inner_steps))


def short_push_scale(steps: Sequence[int], inner_steps: int, mode: str) -> float:
    """The factor a round's outer gradient takes for holding short pushes: 2ρ / (1 + ρ²), ρ the
    pushes' share of H steps each (capped at 1), weighted by their steps as the token-weighted
    mean weighs their deltas; 1 for "none" or a round of whole pushes.

    A delta of n inner steps is the loss's descent, which grows with n, plus the inner loop's
    fluctuation, which does not: a short push's delta is mostly fluctuation. Taken at its size,
    a round of 2 + 16 steps moved fragment 1 of a 2-layer GPT 2.7× as far per step as its whole
    rounds, mostly across the way it was going (chaos run, seed 5: eval 2.331 -> 2.356 in one
    merge). A step k·g gains k·S and costs k²·N. The outer lr is right for whole rounds (k = 1 is
    best: S = 2N); say half of N is the descent's, which shrinks as ρ², and half the fluctuation's,
    which does not. A round of ρ gains ρ·S, so its best k is 2ρ / (1 + ρ²): about 2ρ for short
    rounds, and flat at ρ = 1 (a round of 90% of H steps is within 1% of a whole step).
    """
    if mode == "none" or inner_steps <= 0:
        return 1.0
    total = sum(max(0, s) for s in steps)
    if total <= 0:
        return 1.0
    rho = sum(s * min(1.0, s / inner_steps) for s in steps if s > 0) / total
    return 2 * rho / (1 + rho * rho)


def merge(
    deltas: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float],
    mode: str,
    scale: float = 1.0,
    consume: bool = False,
) -> dict[str, torch.Tensor]:
    """The outer gradient of deltas that are all at hand (benchmarks, simulations): the
    accumulator's fold, so there is one merge arithmetic. With `consume`, the deltas' fp32
    tensors may become the result."""
    acc = MergeAccumulator(mode)
    for delta, weight in zip(deltas, weights, strict=True):
        acc.add(delta, weight, consume=consume)
    return acc.result(scale)


class MergeAccumulator:
    """A round's deltas folded in one by one as they arrive: it holds one fragment's worth of
    tensors however many learners push, where keeping every delta until the round closes holds
    one per learner.

    `rda` (radial-directional averaging) merges each tensor's norm and direction separately: the
    weighted mean of the norms times the direction of the weighted mean of the unit vectors, so
    near-orthogonal deltas do not shrink the step the way a plain mean does.

    Each merge mode is a weighted sum of per-delta terms (the delta itself; for `rda` its unit
    vector, and its norm), so the normalising total can wait until `result`, which equals
    the weighted combination of all the deltas at once up to rounding. Not thread-safe: callers
    that fold from several threads hold a lock.
    """

    def __init__(self, mode: str, plain: frozenset[str] = frozenset()) -> None:
        """`plain`: tensors that come as values (running statistics): their weighted mean, in
        every mode, without the age factor (an older push's statistics are as much a mean)."""
        if mode not in ("mean", "token", "rda"):
            raise ValueError(f"unknown merge mode {mode!r}")
        self.mode = mode
        self.plain = plain
        self.sums: dict[str, torch.Tensor] = {}
        self.norms: dict[str, float] = {}  # rda: Σ w·‖delta‖ per tensor
        self.total_weight = 0.0
        self.reference = 0.0  # the first delta's weight; the others are folded in relative to it
        self.count = 0

    def add(
        self, delta: dict[str, torch.Tensor], weight: float, consume: bool = False, age: float = 1.0
    ) -> None:
        """Fold one delta in with its (unnormalised) weight, scaled by `age` (age_factor) in the
        sum but not in the normaliser. With `consume`, the delta's fp32 tensors may become the
        sums (the caller drops the delta)."""
        if not 0 < weight < math.inf:
            raise ValueError(f"a delta's merge weight must be positive and finite, got {weight}")
        if not 0 < age <= 1:
            raise ValueError(f"a delta's age factor must be in (0, 1], got {age}")
        # Weights are taken relative to the round's first (in float64): the fp32 sums then hold
        # deltas times ratios near 1, whatever the tokens² / steps of a large run (or a lie).
        self.reference = self.reference or weight
        weight = weight / self.reference
        # Checked before anything is added, so a refused delta leaves the sums as they were.
        if self.count and (
            set(delta) != set(self.sums) or any(delta[n].shape != t.shape for n, t in self.sums.items())
        ):
            raise ValueError("deltas of one round must hold the same tensors")
        for name, value in delta.items():
            part = value.to(torch.float32)
            owned = consume and part.data_ptr() == value.data_ptr()
            alpha = weight if name in self.plain else weight * age
            if self.mode == "rda" and name not in self.plain:
                norm = float(part.norm())
                self.norms[name] = self.norms.get(name, 0.0) + alpha * norm
                alpha = alpha / norm if norm > 0 else alpha  # a zero delta adds nothing either way
            if name not in self.sums:
                self.sums[name] = part.mul_(alpha) if owned else part * alpha
            else:
                self.sums[name].add_(part, alpha=alpha)
        self.total_weight += weight
        self.count += 1

    def result(self, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """The outer gradient of everything folded in, times `scale` (the round's coverage); the
        plain tensors' weighted mean times `scale`. The sums become the result: the accumulator
        is spent."""
        if not self.count:
            raise ValueError("no deltas to merge")
        out: dict[str, torch.Tensor] = {}
        for name, total in self.sums.items():
            if self.mode == "rda" and name not in self.plain:
                # direction Σw·u/W times mean norm Σw·n/W, over the direction's norm ‖Σw·u‖/W.
                dnorm = float(total.norm())
                factor = scale * self.norms[name] / (self.total_weight * dnorm) if dnorm > 0 else 0.0
            else:
                factor = scale / self.total_weight
            out[name] = total.mul_(factor)
        self.sums = {}
        return out


def outer_hyper(lr: float, mu: float, warmup_rounds: int, version: int) -> tuple[float, float]:
    """The outer step's (lr, μ) for a fragment's merge into `version` + 1: plain averaging (1, 0)
    at its first merge, moving linearly to (lr, μ) over `warmup_rounds` merges (sync.outer_warmup_rounds)."""
    if warmup_rounds <= 0 or version >= warmup_rounds:
        return lr, mu
    share = version / warmup_rounds
    return 1.0 + (lr - 1.0) * share, mu * share


def outer_step(
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    outer_grad: dict[str, torch.Tensor],
    lr: float,
    mu: float,
    nesterov: bool,
    fraction: float = 1.0,
    consume: bool = False,
    averaged: frozenset[str] = frozenset(),
    share: float = 1.0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SGD with (Nesterov) momentum on the outer gradient, as torch.optim.SGD does it.

    m ← μ·m + g;  θ ← θ − lr·(g + μ·m) with Nesterov, θ ← θ − lr·m without. Returns new tensors.

    A round that holds only a `fraction` f of the learners (its g already scaled by f) is a
    fraction of an outer step: the momentum decays by μ^f and pushes by f·μ·m, so k rounds of 1/k
    each move about as far as one full round — not k times the momentum. f = 1 is the plain step.
    With `consume`, outer_grad's fp32 tensors may be overwritten (no allocation for the update).

    `averaged` (running statistics) come as the pushes' values, g their mean times the round's
    `share` s (its coverage): θ ← (1 − s)·θ + g, no momentum, a mean of values that are never
    negative (a delta against an older base could take a variance below zero).
    """
    decay = mu**fraction
    new_params: dict[str, torch.Tensor] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    for name, theta in params.items():
        if name in averaged:
            mean = outer_grad[name].to(torch.float32)
            merged = torch.add(mean, theta.to(torch.float32), alpha=1.0 - share)
            if name.endswith("running_var"):  # pushes are checked (limits.running_stats_problem); kept so
                merged.clamp_(min=0.0)
            new_params[name] = merged.to(theta.dtype)
            new_momentum[name] = momentum[name]  # zero: never used
            continue
        g = outer_grad[name].to(torch.float32)
        m = torch.add(g, momentum[name], alpha=decay)
        # Fused forms of g + f·μ·m (Nesterov) and f·m + (1 − f)·g: one pass each, no temporaries.
        owned = consume and g.data_ptr() == outer_grad[name].data_ptr()
        if nesterov:
            update = g.add_(m, alpha=fraction * mu) if owned else torch.add(g, m, alpha=fraction * mu)
        else:
            update = g.lerp_(m, fraction) if owned else torch.lerp(g, m, fraction)
        new_params[name] = torch.add(theta.to(torch.float32), update, alpha=-lr).to(theta.dtype)
        new_momentum[name] = m
    return new_params, new_momentum
