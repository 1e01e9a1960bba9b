"""A learner made of N ranks (torchrun): data parallel inside, one learner to the coordinator.

    torchrun --nproc-per-node N -m cli compute --coordinator HOST:PORT

Rank 0 is the learner the coordinator sees: it joins, heartbeats, leases shards, pushes fragment
deltas and takes merges (diloco.compute.learner). The other ranks never open a connection to the
coordinator; they follow rank 0 step by step through a small protocol of collectives:

    rank 0                                       ranks 1..N-1 (run_follower)
    config JSON          -- broadcast -->        build the same model
    every parameter      -- broadcast -->        hold the same replica
    STEP: batch spec + columns -- broadcast -->  train on their part of the rows (DDP all-reduces
                                                 the gradients, so the replicas stay equal)
    GATHER p (FSDP only) -- all-gather -->       fragment p whole on rank 0, for its push
    COPY (FSDP only)     -- all-gather -->       every parameter and AdamW moment whole on rank 0,
                                                 for its local state
    MERGE p: fragment p's tensors -- broadcast --> write them, at the same step as rank 0
                         (FSDP: scattered into the shards)
    STOP                 -- broadcast -->        exit 0

A learner's step is train.batch_size rows whatever its size: its ranks split them, so a run's
config means the same for a 1-rank and an 8-rank learner (H, the learning rate, a push's tokens),
and more ranks only make the steps faster. Inside the group gradients go through torch.distributed's
DDP or FSDP2 (gloo on CPU, NCCL on CUDA; diloco.compute.replicas), never a home-made collective. Rank 0 sends the whole batch and every rank takes its own rows: the batch is
token ids (tens of KB), so one broadcast is cheaper than a scatter's per-rank shapes. Nothing is
pickled: specs travel as int64 tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("diloco.group")

# Rank 0 may wait long for data or an unreachable coordinator while the others wait in a
# broadcast; a dead rank is torchrun's to notice (it takes the group down), not a timeout's.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)

OP_STEP, OP_MERGE, OP_STOP, OP_GATHER, OP_COPY = 1, 2, 3, 4, 5
# What rank 0 shares instead of the run's config when it was refused before the group started.
NO_RUN = "no run"

# dtypes a batch column may have, by a code that travels in the spec.
DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.float32, torch.float16,
          torch.bfloat16, torch.float64, torch.bool]  # fmt: skip


def encode_spec(columns: dict[str, torch.Tensor]) -> torch.Tensor:
    """The names, dtypes and shapes of a batch's columns as one int64 tensor:
    [n, then per column: name length, name bytes..., dtype code, ndim, dims...]."""
    out = [len(columns)]
    for name, t in columns.items():
        raw = name.encode()
        out += [len(raw), *raw, DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(out, dtype=torch.int64)


def decode_spec(spec: torch.Tensor) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    values = spec.tolist()
    n, i, out = values[0], 1, []
    for _ in range(n):
        length = values[i]
        name = bytes(values[i + 1 : i + 1 + length]).decode()
        i += 1 + length
        dtype, ndim = DTYPES[values[i]], values[i + 1]
        shape = tuple(values[i + 2 : i + 2 + ndim])
        i += 2 + ndim
        out.append((name, dtype, shape))
    return out


def rows_of(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, end) of a batch that `rank` trains on. With fewer rows than ranks (a
    shard's last batch), every rank takes them all: the averaged gradient is then the batch's
    own, as a 1-rank learner would compute it."""
    if rows < world:
        return 0, rows
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class Group:
    """This process's place in a learner's torchrun group."""

    rank: int
    world: int
    local_rank: int
    # Where collectives run: the device for NCCL, the CPU for gloo.
    comm_device: torch.device

    @classmethod
    def from_env(cls) -> Group | None:
        """The group torchrun set up for this process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*);
        None when this process is a learner on its own."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        # Before the rendezvous, which waits on the agent's store: an agent killed while this
        # rank was still importing must not leave it waiting there for good.
        watch_parent()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and os.environ.get("DILOCO_GROUP_BACKEND", "") != "gloo"
        if cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), local_rank, device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def device_for(self, chosen: torch.device) -> torch.device:
        """Each rank computes on its own GPU (cuda:LOCAL_RANK); CPU ranks share the CPU."""
        return torch.device("cuda", self.local_rank) if chosen.type == "cuda" else chosen

    # -- text and tensors from rank 0 --------------------------------------------------------

    def share_text(self, text: str | None) -> str:
        """Rank 0's text on every rank (the run's config JSON)."""
        raw = torch.tensor(list(text.encode()) if self.leader and text is not None else [], dtype=torch.uint8)
        size = torch.tensor([raw.numel()], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, 0)
        buf = raw.to(self.comm_device) if self.leader else torch.empty(int(size.item()), dtype=torch.uint8,
                                                                       device=self.comm_device)  # fmt: skip
        dist.broadcast(buf, 0)
        return bytes(buf.cpu().tolist()).decode()

    def no_run(self) -> None:
        """Rank 0, refused before the group started: the other ranks, waiting for the run's config,
        exit quietly (rank 0 says why in one line) instead of with gloo's error when it exits."""
        with contextlib.suppress(Exception):  # the group itself may be what failed
            self.share_text(NO_RUN)

    def share_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0's values of these tensors (the same ones, in the same order, on every rank)
        written into every rank's: the parameters at the start, a fragment after a merge."""
        with torch.no_grad():
            for t in tensors:
                if t.device == self.comm_device:
                    dist.broadcast(t.data, 0)
                else:  # gloo on CPU with parameters on a GPU, or the other way round
                    buf = t.detach().to(self.comm_device)
                    dist.broadcast(buf, 0)
                    t.data.copy_(buf)

    # -- the step protocol --------------------------------------------------------------------

    def send_op(self, op: int, step: int = 0, arg: int = 0) -> None:
        dist.broadcast(torch.tensor([op, step, arg], dtype=torch.int64, device=self.comm_device), 0)

    def recv_op(self) -> tuple[int, int, int]:
        buf = torch.zeros(3, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(buf, 0)
        op, step, arg = buf.tolist()
        return op, step, arg

    def send_batch(self, columns: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Rank 0: the batch to every rank; returns rank 0's own rows of it."""
        self.send_op(OP_STEP, step)
        spec = encode_spec(columns)
        dist.broadcast(torch.tensor([spec.numel()], dtype=torch.int64, device=self.comm_device), 0)
        dist.broadcast(spec.to(self.comm_device), 0)
        for t in columns.values():
            dist.broadcast(t.contiguous().to(self.comm_device), 0)
        return self.own_rows(columns)

    def recv_batch(self) -> dict[str, torch.Tensor]:
        """Ranks 1..N-1, after an OP_STEP: the batch rank 0 sent, this rank's rows of it."""
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, 0)
        spec = torch.zeros(int(size.item()), dtype=torch.int64, device=self.comm_device)
        dist.broadcast(spec, 0)
        columns = {}
        for name, dtype, shape in decode_spec(spec.cpu()):
            t = torch.empty(shape, dtype=dtype, device=self.comm_device)
            dist.broadcast(t, 0)
            columns[name] = t
        return self.own_rows(columns)

    def own_rows(self, columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = next(iter(columns.values())).shape[0]
        start, end = rows_of(rows, self.rank, self.world)
        return {name: t[start:end] for name, t in columns.items()}

    def replicas_equal(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Every rank holds the same values of these tensors (each tensor's float64 sum and sum
        of squares, compared bit for bit across ranks): DDP's averaged gradients and the merges
        sent by rank 0 must leave the replicas equal, and this is the proof after each merge."""
        with torch.no_grad():
            sums = torch.stack(
                [torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]
            ).flatten().to(self.comm_device)  # fmt: skip
        gathered = [torch.empty_like(sums) for _ in range(self.world)]
        dist.all_gather(gathered, sums)
        return all(torch.equal(g, gathered[0]) for g in gathered[1:])

    def mean(self, value: float) -> float:
        """The group's mean of a per-rank number (the loss of each rank's rows)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def stop(self) -> None:
        """Rank 0: the others exit; then the group is torn down."""
        self.send_op(OP_STOP)
        self.close()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_argv(python: str, compute_args: list[str], nproc: int) -> list[str]:
    """The command that makes `diloco compute ARGS --nproc N` an N-rank learner: torchrun on this
    machine alone (--standalone: its own rendezvous on a free local port), each rank running
    `python -m cli compute ARGS` without --nproc (a rank must not start torchrun again)."""
    args, skip = [], False
    for a in compute_args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            args.append(a)
    return [python, "-m", "diloco.compute.agent", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "cli", "compute", *args]  # fmt: skip


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit when the torchrun agent that started this rank is gone. torchrun starts its ranks in
    sessions of their own, so a kill -9 of the agent's process group does not reach them; an
    orphaned rank 0 would go on as a learner nobody supervises. (Already orphaned: the agent died
    while this rank started, and init would wait on its store.)"""
    parent = os.getppid()

    def gone(why: str) -> None:
        log.error("torchrun agent (pid %d) %s: this rank exits", parent, why)
        os._exit(1)

    if parent == 1:
        gone("was gone before this rank started")

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(poll_s)
        gone("is gone")

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()
