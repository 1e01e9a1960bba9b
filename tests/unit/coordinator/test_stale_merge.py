"""A push on a stale base moves the model by sync.stale_decay^lag of what a current one would,
on a real coordinator (the wiring of merging.age_factor into the service's merge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import PLAIN_OUTER_STEP, delta_header, push_and_merge, tiny_coordinator, uniform_delta


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stale_decay", [1.0, 0.5])
def test_a_push_one_version_behind_moves_the_model_by_the_decay(
    tiny_corpus: Path, tmp_path: Path, stale_decay: float
) -> None:
    # A merge moves the model by its delta.
    overrides = {**PLAIN_OUTER_STEP, "sync.stale_decay": stale_decay}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        frag = running.service.fragments[0]
        delta, _ = uniform_delta(init)
        steps: list[float] = []
        for i, base in enumerate((0, 0)):  # the second is based on version 0 once 1 is out
            header = delta_header(learner, "fp32", f"push-{i}")
            header.version = base
            steps.append(push_and_merge(learner, frag, header, delta))
        assert steps[1] == pytest.approx(stale_decay * steps[0], rel=1e-4)
