"""A push on a stale base moves the model by sync.stale_decay^lag of what a current one would,
on a real coordinator (the wiring of syncer.age_factor into the service's merge)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.support import PLAIN_OUTER_STEP, delta_header, moved, tiny_coordinator


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stale_decay", [1.0, 0.5])
def test_a_push_one_version_behind_moves_the_model_by_the_decay(
    tiny_corpus: Path, tmp_path: Path, stale_decay: float
) -> None:
    # A merge moves the model by its delta.
    overrides = {**PLAIN_OUTER_STEP, "sync.stale_decay": stale_decay}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        frag = running.service.fragments[0]
        delta = {n: torch.full_like(t, 1e-3) for n, t in init.items()}
        steps: list[float] = []
        for i, base in enumerate((0, 0)):  # the second is based on version 0 once 1 is out
            before = {n: t.clone() for n, t in frag.params.items()}
            header = delta_header(learner, "fp32", f"push-{i}")
            header.version = base
            assert learner.push(header, delta).accepted
            deadline = time.monotonic() + 20
            while frag.version < i + 1:
                assert time.monotonic() < deadline, "the merge did not come"
                time.sleep(0.02)
            steps.append(moved(before, frag.params))
        assert steps[1] == pytest.approx(stale_decay * steps[0], rel=1e-4)
