"""Ranks 1..N-1 of a learner's torchrun group: they follow rank 0's step protocol
(diloco.compute.group) and never talk to the coordinator."""

from __future__ import annotations

import logging

import torch

from diloco.compute.device import pick_device, set_threads
from diloco.compute.group import NO_RUN, OP_COPY, OP_GATHER, OP_MERGE, OP_STEP, OP_STOP, Group
from diloco.compute.inner import inner_step
from diloco.compute.replicas import Sharded, hold
from diloco.config import RunConfig
from diloco.fragments import assign_fragments
from diloco.model.factory import build_model

log = logging.getLogger("diloco.group")


def run_follower(group: Group, device_spec: str | None, threads: int | None) -> int:
    """Build the run's model, take rank 0's parameters, then train every batch, gather and write
    every fragment rank 0 asks for, until it says stop. Returns the exit code."""
    if (shared := group.share_text(None)) == NO_RUN:
        log.info("rank %d: rank 0 did not start the run (its own line says why)", group.rank)
        return 0
    cfg = RunConfig.from_json(shared)
    kind = group.share_text(None)  # how rank 0 holds the model: ddp or fsdp
    device = group.device_for(pick_device(device_spec or cfg.train.device))
    set_threads(threads if threads is not None else cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    # Sharded: built on the host, and fully_shard moves this rank's part to the device.
    model = build_model(cfg.model, seed=cfg.train.seed).to("cpu" if kind == "fsdp" else device)
    plan = assign_fragments([(n, p.numel()) for n, p in model.named_parameters()], cfg.sync.fragments)
    group.share_tensors(model.parameters())
    held = hold(kind, group, model, device, cfg.train)  # type: ignore[arg-type]
    held.share_optimizer()  # rank 0's AdamW moments: a resumed group's, as replicas.lead sends
    trained = torch.compile(held.train_model) if cfg.train.compile else held.train_model
    log.info("rank %d of %d on %s follows rank 0 (%s)", group.rank, group.world, device, kind)
    steps = 0
    while True:
        op, step, arg = group.recv_op()
        if op == OP_STEP:
            columns = group.recv_batch()
            loss, _ = inner_step(
                trained, held.optimizer, columns, step=step, train=cfg.train, device=device,
                where=f"model.factory {cfg.model.factory}",
            )  # fmt: skip
            group.mean(loss)
            steps += 1
        elif op == OP_GATHER:
            held.follow_gather(plan[arg])
        elif op == OP_MERGE:
            held.follow_merge(plan[arg])
        elif op == OP_COPY and isinstance(held, Sharded):
            held.follow_copy()
        elif op == OP_STOP:
            log.info("rank %d: %d steps; rank 0 says stop", group.rank, steps)
            return 0
        else:
            raise RuntimeError(f"unknown group op {op}")
