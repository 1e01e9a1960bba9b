"""A learner's way into a run: join, check what it was given, build the model, offer the start.

Everything here happens once per learner life, before its first inner step; any of it can
refuse (another tokenizer, a device this machine lacks, init weights of another model), and a
refusal leaves the run with one clear line and a non-zero exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from diloco.client import CoordinatorClient
from diloco.compute.device import pick_device, set_threads
from diloco.compute.held import HeldFragment
from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.fragments import assign_fragments
from diloco.model.contract import (
    ModelContractError,
    group_running_stats_problem,
    layout_difference,
    parameter_layout,
    running_stats,
    synced_tensors,
)
from diloco.model.factory import build_model
from diloco.model.optim import make_inner_optimizer
from diloco.model.weights import check_matches, load_weights
from diloco.plugins import refuse_untrusted_model
from diloco.role import refusing
from diloco.tokenizer import load_checked_tokenizer
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")


@dataclass
class Joined:
    """What a learner holds once it is in the run: the coordinator's answer and its own model."""

    reply: pb.JoinReply
    cfg: RunConfig
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: dict[str, torch.Tensor]  # parameters and running statistics (contract.synced_tensors)
    frags: list[HeldFragment]
    averaged: frozenset[str]  # the running statistics among params: values, merged as a mean


def join_run(
    client: CoordinatorClient,
    *,
    connect_timeout_s: float,
    device: str | None,
    threads: int | None,
    mark: Callable[[str], None],
    own: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
    place: Callable[[torch.device], torch.device] | None = None,
) -> Joined:
    """Join, check the tokenizer and device, build model and optimizer, offer the initial parameters
    when nobody has yet. `mark` records the end of the join and model phases (StartupClock).

    `own`: the model and optimizer of a user's own training loop (diloco.compute.own_loop), used as
    they are, on the device they are on; the process's threads and seed stay the user's too.
    `place`: where this process computes on the chosen kind of device (a torchrun rank: its own GPU)."""
    reply = client.join(connect_timeout_s)
    mark("join")
    cfg = client.config
    assert cfg is not None
    with refusing(client, log):
        if own is None:  # the coordinator names the factory; this machine's operator allows it
            refuse_untrusted_model(cfg.model)
        check_tokenizer(cfg, reply.tokenizer_hash)
        if own is None:
            chosen = pick_device(device or cfg.train.device)
            if place is not None:
                chosen = place(chosen)
    if own is None:
        set_threads(threads if threads is not None else cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        with refusing(client, log):
            model = build_model(cfg.model, seed=cfg.train.seed).to(chosen)
        optimizer = make_inner_optimizer(model, cfg.train)
    else:
        model, optimizer = own
        chosen = next(model.parameters()).device
    with refusing(client, log):
        # A torchrun group: its ranks' running statistics are not kept in step.
        if place is not None and (problem := group_running_stats_problem(model, cfg.model.factory)):
            raise ModelContractError(problem)
    params = synced_tensors(model)  # the parameters and the normalization layers' running statistics
    averaged = frozenset(running_stats(model))
    plan = assign_fragments([(n, p.numel()) for n, p in params.items()], cfg.sync.fragments)
    mark("model")  # tokenizer check, model and optimizer built
    if reply.needs_init:
        with refusing(client, log):
            offered = initial_parameters(params, cfg)
        log.info("init parameters: %s", client.init_parameters(offered, averaged).reason)
    return Joined(
        reply, cfg, chosen, model, optimizer, params, [HeldFragment(names) for names in plan], averaged
    )


def check_tokenizer(cfg: RunConfig, expected_hash: str) -> None:
    """Refuse to train on a tokenizer other than the run's: the model's vocabulary comes from the
    coordinator's config, the shards from its tokenizer."""
    tokenizer = load_checked_tokenizer(cfg.data.tokenizer, expected_hash)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise DilocoError(
            f"model.vocab_size {cfg.model.vocab_size} is below the tokenizer's {tokenizer.vocab_size}"
        )


def initial_parameters(params: dict[str, torch.nn.Parameter], cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The run's starting point: this learner's random init, or the weights of model.init_from."""
    mine = {n: p.detach().cpu() for n, p in params.items()}
    if not cfg.model.init_from:
        return mine
    loaded = load_weights(cfg.model.init_from)
    check_matches(mine, loaded, cfg.model.init_from)
    log.info("initial parameters from %s", cfg.model.init_from)
    return {n: loaded[n].to(mine[n].dtype) for n in mine}


def check_same_model(
    mine: dict[str, torch.nn.Parameter], pulled: dict[str, torch.Tensor], factory: str
) -> None:
    """Refuse to train a model other than the run's: another factory version or other kwargs
    on this machine would otherwise fail (or worse, train) on tensors it does not own."""
    diff = layout_difference(parameter_layout(pulled), parameter_layout(mine))
    if diff:
        raise DilocoError(f"this learner's model ({factory}) is not the run's: {diff}")


def pull_everything(
    client: CoordinatorClient, fragments: int, cfg: RunConfig, connect_timeout_s: float, stop: threading.Event
) -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
    """Every fragment in full. Another learner may still be streaming the initial parameters
    (a big model takes a while): wait for them, as long as we would wait for the coordinator."""
    deadline = time.monotonic() + max(connect_timeout_s, cfg.sync.pull_wait_s)
    everything = list(range(fragments))
    while True:
        try:
            return client.pull(everything, None, wait_s=cfg.sync.pull_wait_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            log.info("no parameters yet (%s); waiting for the learner that initializes them", e.details())
            stop.wait(1.0)
