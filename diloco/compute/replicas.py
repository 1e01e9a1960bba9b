"""How a torchrun group holds its model: whole on every rank (DDP) or sharded over them (FSDP2).

The outer loop (pushes, merges) always works on whole tensors on rank 0: `Learner.params`.

    DDP  (default)  every rank trains a whole replica; the gradients are all-reduced. Rank 0's
                    trained parameters are the outer ones. A merge is broadcast, and the replicas
                    are compared equal after it.
    FSDP (--data-parallel fsdp)  `fully_shard` (torch's FSDP2): each rank holds 1/N of every
                    parameter and of AdamW's state, for a model that does not fit one device.
                    Rank 0 keeps a whole copy of the parameters on the host for the outer loop
                    alone; it is brought up to date (all-gathered) only when the outer loop reads
                    it: before a fragment's push and before a merge is mixed in. A merge is
                    scattered from rank 0 into the shards, then gathered back and compared with
                    rank 0's copy bit for bit.

Both ranks and rank 0 run the same calls in the same order (the group's step protocol,
diloco.compute.group): every collective here is torch.distributed's own.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Literal

import torch

from diloco.compute.group import OP_COPY, OP_GATHER, OP_MERGE, Group
from diloco.compute.local_state import copy_optimizer, plain_groups
from diloco.config import TrainConfig
from diloco.model.optim import make_inner_optimizer

log = logging.getLogger("diloco.group")

DataParallel = Literal["ddp", "fsdp"]


class Replicated:
    """DDP: a whole replica per rank. Its construction also broadcasts rank 0's parameters and
    buffers, a second guard that the replicas start equal."""

    def __init__(self, group: Group, model: torch.nn.Module, device: torch.device, train: TrainConfig,
                 optimizer: torch.optim.Optimizer | None = None):  # fmt: skip
        from torch.nn.parallel import DistributedDataParallel

        self.group = group
        self.params = dict(model.named_parameters())
        self.optimizer = optimizer or make_inner_optimizer(model, train)
        ids = [device.index] if device.type == "cuda" else None
        self.train_model: torch.nn.Module = DistributedDataParallel(model, device_ids=ids)

    def refresh(self, fragment: int, names: list[str], outer: dict[str, torch.nn.Parameter]) -> None:
        """The outer parameters are the trained ones: nothing to bring up to date."""

    def write(self, fragment: int, names: list[str], outer: dict[str, torch.nn.Parameter]) -> None:
        """Rank 0, after writing a merged fragment: the same values on every rank before the next
        step; then every parameter compared across the ranks. Raises if they differ."""
        self.group.send_op(OP_MERGE, arg=fragment)
        self.group.share_tensors(outer[n] for n in names)
        if not self.group.replicas_equal(outer.values()):
            raise RuntimeError(f"the ranks' replicas differ after the merge of fragment {fragment}")

    def follow_merge(self, names: list[str]) -> None:
        self.group.share_tensors(self.params[n] for n in names)
        self.group.replicas_equal(self.params.values())  # rank 0 compares, and stops the group if not

    def follow_gather(self, names: list[str]) -> None:
        raise RuntimeError("a DDP group never gathers: every rank holds the whole model")

    def share_optimizer(self) -> None:
        """Rank 0's inner AdamW state on every rank, once, before the first step. Under DDP the
        ranks' moments stay equal (the same averaged gradients on the same parameters), so rank
        0's are the group's: a group that resumed its local state (rank 0's file) starts every
        rank from them. Fresh, there is no state and only the empty layout travels."""
        state = self.optimizer.state_dict()["state"] if self.group.leader else {}
        layout = _share_layout(self.group, state)
        if not self.group.leader:
            state = {i: {k: _placeholder(spec) for k, spec in entries} for i, entries in layout}
        self.group.share_tensors(state[i][k] for i, entries in layout for k, _ in entries)
        if not self.group.leader and state:
            _load_state(self.optimizer, state)

    def optimizer_copy(self, outer: dict[str, torch.nn.Parameter]) -> dict[str, Any]:
        """Rank 0, for its local state: the trained parameters are `outer` already, and its
        AdamW's moments are every rank's."""
        return copy_optimizer(self.optimizer)


Layout = list[tuple[int, list[tuple[str, tuple[str, list[int]]]]]]


def _share_layout(group: Group, state: dict[int, dict[str, Any]]) -> Layout:
    """Rank 0's optimizer state as [(param index, [(key, (dtype, shape)), ...]), ...] on every
    rank (AdamW's is tensors only: step, exp_avg, exp_avg_sq): what the others allocate to
    receive it."""
    out = []
    for i, entries in sorted(state.items()):
        if not all(isinstance(v, torch.Tensor) for v in entries.values()):
            raise TypeError(f"the inner optimizer's state for parameter {i} holds more than tensors")
        out.append(
            [i, [[k, [str(v.dtype).removeprefix("torch."), list(v.shape)]] for k, v in entries.items()]]
        )
    shared = json.loads(group.share_text(json.dumps(out) if group.leader else None))
    return [(int(i), [(k, (dtype, shape)) for k, (dtype, shape) in entries]) for i, entries in shared]


def _placeholder(spec: tuple[str, list[int]]) -> torch.Tensor:
    dtype, shape = spec
    return torch.empty(shape, dtype=getattr(torch, dtype))


def _load_state(optimizer: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """`state` (by parameter index) into the optimizer; its param groups stay its own."""
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


class Sharded:
    """FSDP2: every module of a repeated stack (each `nn.ModuleList` member: the transformer's
    blocks) is sharded on its own, so only one block is gathered at a time in the forward, then
    the root for the rest (embeddings, head). Gradients are reduce-scattered (averaged, as DDP's);
    AdamW's state exists only for each rank's shard."""

    def __init__(self, group: Group, model: torch.nn.Module, device: torch.device, train: TrainConfig):
        from torch.distributed.fsdp import fully_shard

        self.group = group
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for block in module:
                    if any(True for _ in block.parameters()):
                        fully_shard(block)
        fully_shard(model)
        self.train_model = model
        self.params = dict(model.named_parameters())  # DTensors; FSDP2 keeps the names
        self.optimizer = make_inner_optimizer(model, train)

    def _gathered(self, names: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {n: self.params[n].full_tensor() for n in names}

    def refresh(self, fragment: int, names: list[str], outer: dict[str, torch.nn.Parameter]) -> None:
        """Rank 0: the trained values of fragment p's parameters into its whole copy."""
        self.group.send_op(OP_GATHER, arg=fragment)
        with torch.no_grad():
            for n, value in self._gathered(names).items():
                outer[n].copy_(value)

    def write(self, fragment: int, names: list[str], outer: dict[str, torch.nn.Parameter]) -> None:
        """Rank 0, after writing a merged fragment into its copy: each rank's part of it into
        each rank's shard; then the shards gathered and compared with the copy. Raises if not
        equal."""
        self.group.send_op(OP_MERGE, arg=fragment)
        self._scatter({n: outer[n].detach() for n in names})
        gathered = self._gathered(names)
        if not all(torch.equal(gathered[n].cpu(), outer[n].detach().cpu()) for n in names):
            raise RuntimeError(f"the ranks' shards differ from the merge of fragment {fragment}")

    def follow_merge(self, names: list[str]) -> None:
        with torch.no_grad():
            self._scatter({n: torch.empty(self.params[n].shape, dtype=self.params[n].dtype) for n in names})
        self._gathered(names)  # rank 0 compares

    def follow_gather(self, names: list[str]) -> None:
        self._gathered(names)

    def optimizer_copy(self, outer: dict[str, torch.nn.Parameter]) -> dict[str, Any]:
        """Rank 0, for its local state: every parameter and AdamW moment gathered whole from the
        shards (the trained parameters into `outer`, rank 0's whole copy), so that one file holds
        the group's state; the other ranks take part (follow_copy)."""
        self.group.send_op(OP_COPY)
        with torch.no_grad():
            for n, value in self._gathered(list(self.params)).items():
                outer[n].copy_(value)
        return {
            "state": self._gathered_moments(),
            "param_groups": plain_groups(self.optimizer.state_dict()["param_groups"]),
        }

    def follow_copy(self) -> None:
        self._gathered(list(self.params))
        self._gathered_moments()

    def _gathered_moments(self) -> dict[int, dict[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return {
                i: {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
                    for k, v in entries.items()}
                for i, entries in sorted(self.optimizer.state_dict()["state"].items())
            }  # fmt: skip

    def share_optimizer(self, resumed: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        """Rank 0's whole AdamW state (`resumed`: its unsharded optimizer's, from its local state)
        cut into every rank's shards before the first step, as a merge is; a fresh start sends
        the empty layout alone."""
        from torch.distributed.tensor import distribute_tensor

        layout = _share_layout(self.group, resumed or {})
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, entries in layout:
            p, state[i] = params[i], {}
            for key, spec in entries:
                src = resumed[i][key] if resumed else _placeholder(spec)
                if key != "step" and tuple(spec[1]) == tuple(p.shape):  # a moment: each rank's part
                    src = src.to(device=p.to_local().device)
                    state[i][key] = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=0)
                else:  # the step count
                    self.group.share_tensors([src])
                    state[i][key] = src
        if state:
            _load_state(self.optimizer, state)

    def _scatter(self, whole: dict[str, torch.Tensor]) -> None:
        """Rank 0's whole tensors (the others pass placeholders of the same shape) cut into the
        shards by DTensor's own layout (scattered from rank 0)."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for n, value in whole.items():
                p = self.params[n]
                src = value.to(device=p.to_local().device, dtype=p.dtype)
                part = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(part.to_local())


def hold(
    kind: DataParallel,
    group: Group,
    model: torch.nn.Module,
    device: torch.device,
    train: TrainConfig,
    optimizer: torch.optim.Optimizer | None = None,
) -> Replicated | Sharded:
    """The group's training model for this rank: `model` under DDP, or sharded (FSDP2)."""
    if kind == "fsdp":
        return Sharded(group, model, device, train)
    if kind != "ddp":
        raise ValueError(f"data parallel: ddp or fsdp, not {kind!r}")
    return Replicated(group, model, device, train, optimizer)


def lead(
    kind: DataParallel,
    group: Group,
    config_json: str,
    train: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> Replicated | Sharded:
    """Rank 0, once it holds the run's parameters: the config, the data parallel kind and every
    parameter to the other ranks; returns what trains. Under FSDP rank 0's `model` stays whole
    (the outer loop's copy, moved to the host) and a copy of it is sharded to train."""
    if train.batch_size % group.world:
        log.warning(
            "train.batch_size %d does not split evenly over %d ranks: the mean gradient weighs the "
            "rows of the smaller parts more", train.batch_size, group.world,
        )  # fmt: skip
    group.share_text(config_json)
    group.share_text(kind)
    group.share_tensors(model.parameters())
    if kind == "fsdp":  # the outer copy stays whole on the host; fully_shard puts each rank's
        model.to("cpu")  # part of the trained copy on the device (the mesh's)
        sharded = Sharded(group, copy.deepcopy(model), device, train)
        sharded.share_optimizer(optimizer.state_dict()["state"])  # a resumed rank 0's moments
        optimizer.state.clear()  # the whole moments are in the shards now: not kept twice
        return sharded
    held = hold(kind, group, model, device, train, optimizer)
    held.share_optimizer()  # a resumed rank 0's moments (run_follower takes part)
    return held
