"""Applying a merged fragment τ steps after its push: the steps since the push are kept
(sync.keep_overlap) or overwritten, and the rows they trained on wait for the right push."""

from __future__ import annotations

import torch

from diloco.compute.batch import Batch
from diloco.compute.held import HeldFragment
from diloco.compute.learner import Learner
from diloco.compute.sync_channel import Merged
from diloco.config import RunConfig


class Submitted:
    """Stands in for the learner's SyncChannel: records what the training thread hands it."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.submitted = 0

    def submit(self, header, tensors) -> int:
        self.jobs.append((header, tensors))
        self.submitted += 1
        return self.submitted


def learner_with_one_tensor(keep: bool) -> Learner:
    learner = Learner("127.0.0.1:1")  # the channel to it is never used
    learner.cfg = RunConfig().with_overrides({"sync.keep_overlap": keep, "sync.fragments": 2})
    learner.device = torch.device("cpu")
    weight = torch.nn.Parameter(torch.ones(4))
    learner.params = {"w": weight}
    learner.frags = [HeldFragment(["w"]), HeldFragment([])]
    learner._apply(Merged.full(0, 0, {"w": torch.ones(4)}))
    learner.frags[1].version = 0
    learner.channel = Submitted()  # type: ignore[assignment]
    return learner


def train(learner: Learner, by: float, shard: int) -> None:
    """One 'inner step' that moves w by -by and trains rows [0, 4) of `shard`."""
    with torch.no_grad():
        learner.params["w"].sub_(by)
    rows = torch.zeros((4, 4), dtype=torch.int64)
    learner.progress.inner_steps += 1
    for f in learner.frags:
        f.steps += 1
        f.tokens += 12
    learner.rows.trained(Batch.of_shard({"input_ids": rows}, shard, 0, 4))


def test_the_steps_since_the_push_stay_on_top_of_the_merge() -> None:
    learner = learner_with_one_tensor(keep=True)
    train(learner, 0.1, shard=1)
    learner._push(0)
    train(learner, 0.05, shard=2)  # in the overlap: after the push, before its merge
    learner._push(1)  # shard 2's rows are in fragment 1's push now; they wait for fragment 0's
    learner._apply(Merged.full(0, 1, {"w": torch.full((4,), 0.8)}))
    assert torch.allclose(learner.params["w"].detach(), torch.full((4,), 0.75))
    f = learner.frags[0]
    assert (f.version, f.steps, f.tokens) == (1, 1, 12)  # the overlap step is its next push's
    assert torch.allclose(f.base["w"], torch.full((4,), 0.8))
    # Shard 2's rows are in w's kept progress: they still wait for fragment 0's next push.
    assert [(g.rows.spans, g.waiting) for g in learner.rows.awaiting] == [([(2, 0, 4)], {0})]
    assert not learner.rows.resolved.spans


def test_without_keep_the_overlap_is_overwritten() -> None:
    learner = learner_with_one_tensor(keep=False)
    train(learner, 0.1, shard=1)
    learner._push(0)
    train(learner, 0.05, shard=2)
    learner._push(1)
    learner._apply(Merged.full(0, 1, {"w": torch.full((4,), 0.8)}))
    assert torch.allclose(learner.params["w"].detach(), torch.full((4,), 0.8))
    assert (learner.frags[0].steps, learner.frags[0].tokens) == (0, 0)
    # Overwritten: what fragment 0 held of shard 2's rows is as far as they get; they ride on
    # the next push.
    assert not learner.rows.awaiting and learner.rows.resolved.spans == [(2, 0, 4)]
