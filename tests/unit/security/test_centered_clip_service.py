"""A learner inside the norm bound pushing the model the wrong way, on a real coordinator: with
sync.center_clip its push is taken but pulled toward the fragment's mean step, so the fragment
keeps going its way; without it, the one push turns the fragment round. A restart keeps the
deviations the clip compares with (coordinator/centered_clip.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from diloco.wire import codecs
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


def sent(delta: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """The delta as a learner streams it: fp32 tensors, else one encoded blob per tensor."""
    if codec == "fp32":
        return delta
    return {
        n: torch.frombuffer(bytearray(codecs.encode(t, codec)), dtype=torch.uint8) for n, t in delta.items()
    }


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in sorted(params)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "bound, codec", [(0.0, "fp32"), (2.0, "fp32"), (2.0, "int8")], ids=["off", "on", "on-int8"]
)  # int8: the decoded delta is the one pulled
def test_a_reversed_push_inside_the_norm_bound_is_pulled_back_to_the_fragments_way(
    tiny_corpus: Path, tmp_path: Path, bound: float, codec: str
) -> None:
    overrides = {**OVERRIDES, "sync.center_clip": bound, "sync.codec": codec}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (
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
            h.version, h.codec = running.service.fragments[0].version, codec
            assert learner.push(h, sent({n: way[n] + noise[n] for n in init}, codec)).accepted
            merged(running, i + 1)
        before = flat(running.service.fragments[0].params)
        # Reversed at 8× the honest deltas' norm: under the outlier bar (10×), so it is taken.
        h = header(shard, (10 * HONEST, 10 * HONEST + 10), "reversed")
        h.version, h.codec = running.service.fragments[0].version, codec
        reply = learner.push(h, sent({n: -8.0 * way[n] for n in init}, codec))
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
