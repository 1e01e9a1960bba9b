"""How a learner group holds its model (diloco.compute.replicas), on two real gloo ranks: FSDP2's
shards train what DDP's whole replicas train, rank 0's whole copy is what the shards hold after a
gather, and a merge written into the shards is every rank's."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from diloco.compute.group import OP_GATHER, OP_STOP, Group
from diloco.compute.inner import inner_step
from diloco.compute.replicas import Replicated, Sharded, hold
from diloco.config import ModelConfig, TrainConfig
from diloco.model.factory import build_model
from tests.unit.compute.test_group import join_two, spawn_two

TRAIN = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=0)
MODEL = ModelConfig(kwargs={"n_layer": 2, "n_embd": 32, "n_head": 2}, vocab_size=64, seq_len=16)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 64, (TRAIN.batch_size, 17), generator=g)}


def train(held: Replicated | Sharded, group: Group, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        rows = group.own_rows(batch(step))
        loss, _ = inner_step(held.train_model, held.optimizer, rows, step=step, train=TRAIN,
                             device=torch.device("cpu"))  # fmt: skip
        losses.append(group.mean(loss))
    return losses


def two_ranks(rank: int, port: int, out: dict) -> None:
    group = join_two(rank, port)
    model = build_model(MODEL, seed=0)
    whole = copy.deepcopy(model)  # rank 0's outer copy under FSDP
    outer = dict(whole.named_parameters())
    ddp = hold("ddp", group, copy.deepcopy(model), torch.device("cpu"), TRAIN)
    fsdp = hold("fsdp", group, copy.deepcopy(model), torch.device("cpu"), TRAIN)
    result: dict = {"ddp_losses": train(ddp, group, 4), "fsdp_losses": train(fsdp, group, 4)}
    names = list(outer)
    # Each rank holds about half of every parameter, and AdamW's state for that half alone.
    result["local"] = sum(p.to_local().numel() for p in fsdp.params.values())
    result["whole"] = sum(p.numel() for p in outer.values())
    result["adam"] = sum(s["exp_avg"].to_local().numel() for s in fsdp.optimizer.state.values())
    if group.leader:  # what the outer loop reads: the shards' values, gathered into the copy
        fsdp.refresh(0, names, outer)
        result["gap_to_ddp"] = max(
            (outer[n] - ddp.params[n]).abs().max().item() for n in names
        )  # fmt: skip
        with torch.no_grad():  # a merge: rank 0 writes its copy, then every shard takes its part
            for p in outer.values():
                p.fill_(0.25)
        fsdp.write(0, names, outer)
        with torch.no_grad():  # rank 0's copy moves away from the shards...
            outer[names[0]].add_(1.0)
        try:
            fsdp.write(1, names[1:], outer)  # ("fragment 1": all but the first) is not written...
            fsdp.refresh(0, names, outer)  # ...and a gather puts the shards' value back
            result["restored"] = outer[names[0]].eq(0.25).all().item()
            scatter = fsdp._scatter  # shards that do not take what rank 0 sent are caught
            fsdp._scatter = lambda whole: scatter({n: t + 1 for n, t in whole.items()})  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="shards differ from the merge of fragment 2"):
                fsdp.write(2, names[:1], outer)
            fsdp._scatter = scatter  # type: ignore[method-assign]
            fsdp.write(0, names, outer)
            result["caught"] = True
        finally:
            group.send_op(OP_STOP)
    else:
        while (op := group.recv_op())[0] != OP_STOP:
            follow = fsdp.follow_gather if op[0] == OP_GATHER else fsdp.follow_merge
            follow({0: names, 1: names[1:], 2: names[:1]}[op[2]])
    with torch.no_grad():
        result["shards_after_merge"] = all(p.to_local().eq(0.25).all().item() for p in fsdp.params.values())
    out[rank] = result
    group.close()


@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform != "linux", reason="gloo on loopback")
def test_sharded_ranks_train_what_whole_replicas_train() -> None:
    zero, one = spawn_two(two_ranks)
    # The same loss at every step: FSDP's reduce-scatter averages as DDP's all-reduce does.
    assert zero["fsdp_losses"] == pytest.approx(zero["ddp_losses"], rel=1e-5)
    assert zero["fsdp_losses"][-1] < zero["fsdp_losses"][0]
    assert zero["gap_to_ddp"] < 1e-5
    for r in (zero, one):
        assert r["local"] <= r["whole"] // 2 + 64 and r["adam"] == r["local"]
        assert r["shards_after_merge"]
    assert zero["restored"] and zero["caught"]
