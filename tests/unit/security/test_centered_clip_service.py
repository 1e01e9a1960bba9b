"""A learner inside the norm bound pushing the model the wrong way, on a real coordinator: with
sync.center_clip its push is taken but pulled toward the fragment's mean step, so the fragment
keeps going its way; without it, the one push turns the fragment round. A restart keeps the
deviations the clip compares with (coordinator/centered_clip.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.support import start_coordinator_here, tiny_coordinator
from tests.unit.security.test_merge_attacks import header

# H = 10 steps at the fixture's batch of 1: each push's 10 rows are a full H. No warm-up: every
# merge is a whole Nesterov step, so the momentum's way is the honest pushes' from the first.
OVERRIDES = {
    "sync.max_staleness": 1000, "data.epochs": 4, "train.inner_steps": 10, "sync.overlap_steps": 0,
    "sync.outer_warmup_rounds": 0,
}  # fmt: skip
HONEST = 6


def merged(running, version: int) -> None:
    deadline = time.monotonic() + 20
    while running.service.fragments[0].version < version:
        assert time.monotonic() < deadline, f"no merge into version {version}"
        time.sleep(0.05)


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in sorted(params)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bound", [0.0, 2.0], ids=["off", "on"])
def test_a_reversed_push_inside_the_norm_bound_is_pulled_back_to_the_fragments_way(
    tiny_corpus: Path, tmp_path: Path, bound: float
) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {**OVERRIDES, "sync.center_clip": bound}) as (
        running,
        learner,
        init,
    ):
        shard = learner.lease_shard().shard_id
        g = torch.Generator().manual_seed(0)
        way = {n: torch.randn(t.shape, generator=g) * 1e-4 for n, t in init.items()}
        for i in range(HONEST):
            noise = {n: torch.randn(t.shape, generator=g) * 3e-5 for n, t in init.items()}
            h = header(shard, (10 * i, 10 * i + 10), f"honest-{i}")
            h.version = running.service.fragments[0].version
            assert learner.push(h, {n: way[n] + noise[n] for n in init}).accepted
            merged(running, i + 1)
        before = flat(running.service.fragments[0].params)
        # Reversed at 8× the honest deltas' norm: under the outlier bar (10×), so it is taken.
        h = header(shard, (10 * HONEST, 10 * HONEST + 10), "reversed")
        h.version = running.service.fragments[0].version
        reply = learner.push(h, {n: -8.0 * way[n] for n in init})
        assert reply.accepted, reply
        merged(running, HONEST + 1)
        along = float((flat(running.service.fragments[0].params) - before) @ flat(way))
        clipped = running.ledger.counters().get("pushes_center_clipped", 0)
        # Counted where an operator looks: status, and Prometheus.
        assert running.service.status_detail()["pushes_center_clipped"] == clipped
        scraped = {s.name: s.value for f in running.service.metrics.registry.collect() for s in f.samples}
        assert scraped["diloco_pushes_center_clipped_total"] == clipped
        deviations = list(running.service.fragments[0].recent_deviations)
        config = running.service.config
        learner.close()
        running.stop()
    if bound:
        # Its deviation kept at 2× the others' median: the fragment still moves its way
        # (the parameters move against the outer gradient: a step along `way` lowers them).
        assert clipped == 1 and along < 0, along
    else:
        assert clipped == 0 and along > 0, along
    # The deviations the next push is compared with come back after a restart.
    again = start_coordinator_here(config, str(tmp_path), "127.0.0.1")
    try:
        assert list(again.service.fragments[0].recent_deviations) == pytest.approx(deviations)
    finally:
        again.stop()
