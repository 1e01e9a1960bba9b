"""A round of short pushes is scaled by 2ρ/(1 + ρ²) (ρ: its pushes' share of H steps): the rule, and
a real coordinator applying it to the merge of one learner's short push."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from diloco.config import RunConfig
from diloco.config_parse import ConfigError
from diloco.coordinator import syncer
from tests.support import PLAIN_OUTER_STEP, delta_header, moved, tiny_coordinator


def balanced(rho: float) -> float:
    return 2 * rho / (1 + rho * rho)


def test_whole_pushes_and_none_are_not_scaled() -> None:
    assert syncer.short_push_scale([50, 50], 50, "balanced") == 1.0
    assert syncer.short_push_scale([80], 50, "balanced") == 1.0  # more than H counts as whole
    assert syncer.short_push_scale([5, 5], 50, "none") == 1.0
    assert syncer.short_push_scale([], 50, "balanced") == 1.0  # nothing to scale


def test_short_pushes_are_scaled_about_by_their_share() -> None:
    assert syncer.short_push_scale([9, 9], 50, "balanced") == pytest.approx(balanced(0.18))
    assert syncer.short_push_scale([4], 50, "balanced") == pytest.approx(balanced(0.08))
    assert 1.9 * 0.08 < balanced(0.08) < 2 * 0.08


def test_nearly_whole_rounds_keep_nearly_a_whole_step() -> None:
    # Flat at ρ = 1: the rounds of a chaos run that lost a few steps to a kill (88-97 of 100).
    assert syncer.short_push_scale([44, 44], 50, "balanced") > 0.99
    # Weighted by steps, as the token-weighted mean weighs the deltas: 4 steps beside 50.
    assert syncer.short_push_scale([50, 4], 50, "balanced") == pytest.approx(balanced((50 + 4 * 0.08) / 54))
    assert syncer.short_push_scale([50, 4], 50, "balanced") > 0.99


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
        delta = {n: torch.full_like(t, 1e-3) for n, t in init.items()}
        whole = moved({n: torch.zeros_like(t) for n, t in delta.items()}, delta)

        def merge(steps: int, push_id: str, row_start: int) -> float:
            header = delta_header(learner, "fp32", push_id)
            header.version, header.inner_steps = frag.version, steps
            del header.spans[:]
            header.spans.add(
                shard_id=learner.lease_shard().shard_id, row_start=row_start, row_end=row_start + 2
            )
            before, version = {n: t.clone() for n, t in frag.params.items()}, frag.version
            assert learner.push(header, delta).accepted
            deadline = time.monotonic() + 20
            while frag.version == version:
                assert time.monotonic() < deadline, "the round did not close"
                time.sleep(0.02)
            return moved(before, frag.params)

        # The first merge is plain averaging, a short push or not: never scaled.
        assert merge(h // 5, "first", 0) == pytest.approx(whole, rel=1e-4)
        expected = balanced(0.2) if mode == "balanced" else 1.0
        assert merge(h // 5, "short", 10) == pytest.approx(expected * whole, rel=1e-4)
        assert merge(h, "whole", 20) == pytest.approx(whole, rel=1e-4)
