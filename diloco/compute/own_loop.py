"""Keep your own training loop: diloco does the rest around it.

    import diloco

    with diloco.connect("coordinator:7000", model, optimizer) as run:   # the global Θ is in `model`
        for batch in run.batches():              # prefetched shard rows, on the model's device
            loss = model(batch)                  # your forward, loss, schedule, clipping, AMP...
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.step(loss)                       # after each optimizer step

Between two batches diloco pushes the fragment that is due, applies the merges that are due (τ
steps after their push, the steps since kept), sends heartbeats, keeps error feedback, and follows
a coordinator that restarts; the batches end when the data, the token budget or the run does.
Leaving the block hands in what was not pushed yet; an exception leaves without it (a restart
with the same worker_id and state_dir resumes the work kept on local disk).

The model must be the run's (the same tensor names, shapes and dtypes as the global model); it
is refused with one line otherwise. The first learner to join offers its parameters as the init.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from diloco.compute.batch import Batch
from diloco.compute.learner import Learner
from diloco.compute.overrides import LocalOverrides
from diloco.errors import DilocoError


class Run:
    """A connected learner whose inner step is the caller's; made by `connect`."""

    def __init__(self, learner: Learner) -> None:
        self._learner = learner
        self._heartbeats: threading.Thread | None = None
        self._pending: Batch | None = None  # handed out, its step not reported yet
        self._handed_at = 0.0
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self._learner.client.worker_id

    @property
    def config(self) -> Any:
        """The run's RunConfig, as the coordinator gave it at join (batch size, H, τ, ...)."""
        return self._learner.cfg

    @property
    def inner_steps(self) -> int:
        return self._learner.progress.inner_steps

    @property
    def resumed_at_step(self) -> int | None:
        """The step this learner resumed at from its local state (worker_id + state_dir), or None:
        it started from the global model."""
        resumed = self._learner.resumed
        return resumed.inner_steps if resumed is not None else None

    @property
    def resume_reason(self) -> str:
        """Why the local state kept by the last life was resumed, or why not ("" when there was none)."""
        return self._learner.resume_reason

    @property
    def ended_because(self) -> str:
        return getattr(self._learner, "ended_because", "")

    def _open(self) -> Run:
        self._learner._setup()
        self._heartbeats = self._learner._start()
        return self

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The run's training batches, {column: tensor} on the model's device, until it ends."""
        device = self._learner.device
        for batch in self._learner._steps():
            self._pending, self._handed_at = batch, time.monotonic()
            yield batch.to(device)
            if self._pending is not None:
                raise DilocoError("call run.step(loss) after each optimizer step, before the next batch")

    def step(self, loss: torch.Tensor | float, metrics: dict[str, float] | None = None) -> None:
        """Report the optimizer step just taken on the last batch, with its loss (and metrics to
        show in `diloco status`, e.g. accuracy)."""
        if self._pending is None:
            raise DilocoError("run.step() without a batch: call it once per batch of run.batches()")
        value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
        metrics = {
            k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in (metrics or {}).items()
        }
        self._learner._stepped(self._pending, value, time.monotonic() - self._handed_at, metrics)
        self._pending = None

    def close(self, hand_in: bool = True) -> None:
        """Hand in what was not pushed yet (waits for its merge, bounded) and leave the run."""
        if self._closed or self._heartbeats is None:
            return
        self._closed = True
        reason = self.ended_because or "left"
        if hand_in:
            self._learner._hand_in_and_leave(reason, self._heartbeats)
        else:
            self._learner._leave("stopped", self._heartbeats)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(hand_in=kind is None)


def connect(
    coordinator: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    worker_id: str | None = None,
    state_dir: str | None = None,
    connect_timeout_s: float = 60.0,
    stop: threading.Event | None = None,
) -> Run:
    """Join the run at `coordinator` (HOST:PORT) with this model and its optimizer, and load the
    global parameters into the model. `worker_id` + `state_dir`: keep this learner's state on
    local disk, so a restart resumes it (see `train.local_state_every_s`)."""
    overrides = LocalOverrides(connect_timeout_s=connect_timeout_s, worker_id=worker_id, state_dir=state_dir)
    learner = Learner(coordinator, overrides, stop)
    learner.own = (model, optimizer)
    return Run(learner)._open()
