"""A learner whose deltas go against the other learners', on a real coordinator: within every norm
bound, so each push is merged, and named for it in Status, in Prometheus and once in the log; the
honest learners beside it are not (coordinator/pusher_watch.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.v1 import coordinator_pb2 as pb
from tests.support import tiny_coordinator
from tests.unit.security.test_merge_attacks import header

# H = 10 steps at the fixture's batch of 1: each push's 10 rows are a full H.
OVERRIDES = {"sync.max_staleness": 1000, "data.epochs": 4, "train.inner_steps": 10, "sync.overlap_steps": 0}
ROUNDS = 8


@pytest.mark.timeout(120)
def test_a_learner_pushing_against_the_others_is_named_and_the_honest_are_not(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="diloco.coordinator")
    with tiny_coordinator(tiny_corpus, tmp_path, OVERRIDES) as (running, first, init):
        more = [CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE) for _ in range(2)]
        try:
            for learner in more:
                learner.join()
            learners = [first, *more]
            hostile = learners[2].worker_id
            shards = [learner.lease_shard().shard_id for learner in learners]
            g = torch.Generator().manual_seed(0)
            way = {n: torch.randn(t.shape, generator=g) * 1e-4 for n, t in init.items()}  # the data's way
            for i in range(ROUNDS):
                for k, learner in enumerate(learners):
                    # The same size as the others' (no norm rule names it), the other way.
                    sign = -1.0 if learner.worker_id == hostile else 1.0
                    delta = {
                        n: sign * way[n] + torch.randn(t.shape, generator=g) * 5e-5 for n, t in init.items()
                    }
                    h = header(shards[k], (10 * i, 10 * i + 10), f"{k}-{i}")
                    h.version = running.service.fragments[0].version
                    reply = learner.push(h, delta)
                    assert reply.accepted, reply
            deadline = time.monotonic() + 30
            while running.ledger.counters().get("pushes_received", 0) < 3 * ROUNDS:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            detail = running.service.status_detail()
            assert list(detail["suspect_learners"]) == [hostile], detail["suspect_learners"]
            assert "does not go their way" in detail["suspect_learners"][hostile]
            shown = {w["worker_id"]: w for w in detail["workers"]}
            assert shown[hostile]["delta_alignment"] < 0 < shown[first.worker_id]["delta_alignment"]
            assert all(0.5 < shown[w.worker_id]["delta_norm_ratio"] < 2 for w in learners)
            scraped = {
                s.labels["worker"]: s.value
                for family in running.service.metrics.registry.collect()
                if family.name == "diloco_learner_suspect"
                for s in family.samples
            }
            assert scraped == {first.worker_id: 0.0, more[0].worker_id: 0.0, hostile: 1.0}
        finally:
            for learner in more:
                learner.close()
    named = [r.getMessage() for r in caplog.records if "looks hostile or broken" in r.getMessage()]
    assert len(named) == 1 and hostile in named[0] and "diloco certs revoke" in named[0], named
