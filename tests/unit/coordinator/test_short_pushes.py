"""A round of short pushes is scaled by 2ρ/(1 + ρ²) (ρ: its pushes' share of H steps): the rule, and
a real coordinator applying it to the merge of one learner's short push."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.config_parse import ConfigError
from diloco.coordinator import merging
from tests.support import PLAIN_OUTER_STEP, delta_header, push_and_merge, tiny_coordinator, uniform_delta


def balanced(rho: float) -> float:
    return 2 * rho / (1 + rho * rho)


def test_whole_pushes_and_none_are_not_scaled() -> None:
    assert merging.short_push_scale([50, 50], 50, "balanced") == 1.0
    assert merging.short_push_scale([80], 50, "balanced") == 1.0  # more than H counts as whole
    assert merging.short_push_scale([5, 5], 50, "none") == 1.0
    assert merging.short_push_scale([], 50, "balanced") == 1.0  # nothing to scale


def test_short_pushes_are_scaled_about_by_their_share() -> None:
    assert merging.short_push_scale([9, 9], 50, "balanced") == pytest.approx(balanced(0.18))
    assert merging.short_push_scale([4], 50, "balanced") == pytest.approx(balanced(0.08))
    assert 1.9 * 0.08 < balanced(0.08) < 2 * 0.08


def test_nearly_whole_rounds_keep_nearly_a_whole_step() -> None:
    # Flat at ρ = 1: the rounds of a chaos run that lost a few steps to a kill (88-97 of 100).
    assert merging.short_push_scale([44, 44], 50, "balanced") > 0.99
    # Weighted by steps, as the token-weighted mean weighs the deltas: 4 steps beside 50.
    assert merging.short_push_scale([50, 4], 50, "balanced") == pytest.approx(balanced((50 + 4 * 0.08) / 54))
    assert merging.short_push_scale([50, 4], 50, "balanced") > 0.99


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="short_push_scale"):
        RunConfig().with_overrides({"sync.short_push_scale": "sqrt"}).validate()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["balanced", "none"])
def test_a_coordinator_scales_a_short_push_after_the_first_merge(
    tiny_corpus: Path, tmp_path: Path, mode: str
) -> None:
    overrides = {**PLAIN_OUTER_STEP, "sync.short_push_scale": mode}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        frag = running.service.fragments[0]
        h = running.service.config.train.inner_steps
        delta, whole = uniform_delta(init)

        def merge(steps: int, push_id: str) -> float:
            header = delta_header(learner, "fp32", push_id)  # rows of a shard of its own
            header.version, header.inner_steps = frag.version, steps
            header.tokens = steps * (running.service.config.model.seq_len + 1)  # a row a step
            return push_and_merge(learner, frag, header, delta)

        # The first merge is plain averaging, a short push or not: never scaled.
        assert merge(h // 5, "first") == pytest.approx(whole, rel=1e-4)
        expected = balanced(0.2) if mode == "balanced" else 1.0
        assert merge(h // 5, "short") == pytest.approx(expected * whole, rel=1e-4)
        assert merge(h, "whole") == pytest.approx(whole, rel=1e-4)
