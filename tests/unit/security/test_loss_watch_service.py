"""A learner that reports a training loss far above the other's (a learner climbing the loss: a
flipped sign, a broken GPU), on a real coordinator with two learners: its deltas are like the
other's in size and way, so only its loss names it, measured on the run's first round's loss.
With sync.refuse_suspects its pushes are refused from then on; a restart keeps it named (the
ledger keeps each push's loss and the first round's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.coordinator.pusher_watch import SUSPECT_REFUSAL
from tests.support import tiny_coordinator
from tests.unit.security.test_merge_attacks import header
from tests.unit.security.test_pusher_watch_service import (
    OVERRIDES,
    all_merged,
    joined,
    restarted,
    samples,
    stopped,
)

ROUNDS = 8
LOSSES = (3.0, 12.0)  # the honest learner's, the climber's


def push_rounds(running, learners, init, shards, rounds) -> list[int]:
    """Both learners push alike each round, the second reporting a loss four times the first's;
    the rounds in which its push was refused."""
    g = torch.Generator().manual_seed(0)
    way = {n: torch.randn(t.shape, generator=g) * 1e-4 for n, t in init.items()}
    refused, taken = [], running.ledger.counters().get("pushes_received", 0)
    for i in rounds:
        for k, learner in enumerate(learners):
            delta = {n: way[n] + torch.randn(t.shape, generator=g) * 5e-5 for n, t in init.items()}
            h = header(shards[k], (10 * i, 10 * i + 10), f"{k}-{i}")
            h.version, h.mean_loss = running.service.fragments[0].version, LOSSES[k]
            reply = learner.push(h, delta)
            if k == 1 and not reply.accepted:
                assert reply.reason.startswith(SUSPECT_REFUSAL) and "training loss" in reply.reason
                refused.append(i)
            else:
                assert reply.accepted, reply
                taken += 1
        all_merged(running, taken)  # its merge in before the next round: the first loss known
    return refused


@pytest.mark.timeout(120)
def test_a_learner_reporting_a_loss_far_above_the_others_is_named_and_refused_and_stays_so(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    overrides = {**OVERRIDES, "sync.refuse_suspects": True}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        learners, shards = joined(running, first, 1)
        ids = [learner.worker_id for learner in learners]
        try:
            refused = push_rounds(running, learners, init, shards, range(ROUNDS))
            # Named once both have MIN_LOSSES losses (the run's first loss known by then): its
            # third push on, every one refused.
            assert refused == list(range(2, ROUNDS)), refused
            detail = running.service.status_detail()
            assert list(detail["suspect_learners"]) == [ids[1]]
            assert "the other learners' 3" in detail["suspect_learners"][ids[1]]
            shown = {w["worker_id"]: w for w in detail["workers"]}
            scale = running.service.loss_scale
            assert shown[ids[1]]["loss_excess"] == pytest.approx((12.0 - 3.0) / scale, abs=1e-3)
            assert samples(running, "diloco_learner_loss_excess", "worker")[ids[0]] < 0
        finally:
            config = stopped(running, learners)
    with restarted(config, tmp_path, ids) as (again, back):
        assert again.service.loss_scale == scale
        assert list(again.service.status_detail()["suspect_learners"]) == [ids[1]]
        assert push_rounds(again, back, init, shards, range(ROUNDS, ROUNDS + 1)) == [ROUNDS]
