"""The learner: H inner AdamW steps on its own, then a delta to the syncer and new globals back.

    join -> (init) -> pull Θ -> loop:
        H inner steps on prefetched batches         (the only thing a learner waits on is data)
        Δ_p = Θ_p(base) − θ_p, with steps, tokens and the shard rows used -> push
        pull Θ_p newer than base -> θ_p ← Θ_p, base ← Θ_p

Only this process's rank 0 talks to the coordinator; the inner loop is plain PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from diloco.client import CoordinatorClient
from diloco.compute.device import pick_device, set_threads
from diloco.compute.prefetch import DONE, Batch, ShardPrefetcher
from diloco.config import RunConfig
from diloco.fragments import assign_fragments
from diloco.model.gpt import build_model, lr_at, make_inner_optimizer
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")


@dataclass
class LocalOverrides:
    """Settings that belong to this machine, not to the run."""

    device: str | None = None
    threads: int | None = None
    step_delay_s: float | None = None
    connect_timeout_s: float = 60.0


@dataclass
class Progress:
    """What the learner reports in heartbeats (and what utilization is computed from)."""

    inner_steps: int = 0
    tokens_trained: int = 0
    last_loss: float = math.nan
    first_loss: float = math.nan
    busy_s: float = 0.0
    stall_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def wall_s(self) -> float:
        return time.monotonic() - self.started


@dataclass
class RoundWork:
    """Work since the last push: counters and the shard rows it trained on."""

    steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def add(self, batch: Batch, loss: float) -> None:
        self.steps += 1
        self.tokens += batch.tokens
        self.loss_sum += loss
        if self.spans and self.spans[-1][0] == batch.shard_id and self.spans[-1][2] == batch.row_start:
            self.spans[-1] = (batch.shard_id, self.spans[-1][1], batch.row_end)
        else:
            self.spans.append((batch.shard_id, batch.row_start, batch.row_end))
        if batch.last_of_shard:
            self.released.append(batch.shard_id)


class Learner:
    def __init__(
        self, address: str, overrides: LocalOverrides | None = None, stop: threading.Event | None = None
    ):
        self.client = CoordinatorClient(address, pb.ROLE_COMPUTE)
        self.overrides = overrides or LocalOverrides()
        self.stop = stop or threading.Event()
        self.finishing = threading.Event()
        self.progress = Progress()
        self.versions: list[int] = []
        self.base: dict[str, torch.Tensor] = {}

    # -- set-up ---------------------------------------------------------------------------------

    def _setup(self) -> RunConfig:
        reply = self.client.join(self.overrides.connect_timeout_s)
        cfg = self.client.config
        assert cfg is not None
        self.cfg = cfg
        self.device = pick_device(self.overrides.device or cfg.train.device)
        set_threads(self.overrides.threads if self.overrides.threads is not None else cfg.train.threads)
        self.step_delay_s = (
            self.overrides.step_delay_s if self.overrides.step_delay_s is not None else cfg.train.step_delay_s
        )
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, cfg.model.vocab_size, cfg.train.seed).to(self.device)
        self.optimizer = make_inner_optimizer(self.model, cfg.train)
        self.params = dict(self.model.named_parameters())
        self.fragments = assign_fragments(
            [(n, p.numel()) for n, p in self.params.items()], cfg.sync.fragments
        )
        self.versions = [-1] * len(self.fragments)
        if reply.needs_init:
            init = self.client.init_parameters({n: p.detach().cpu() for n, p in self.params.items()})
            log.info("init parameters: %s", init.reason)
        self._pull(list(range(len(self.fragments))), wait_s=cfg.sync.pull_wait_s, have=None)
        log.info(
            "learner %s on %s: %d params in %d fragment(s), H=%d",
            self.client.worker_id,
            self.device,
            sum(p.numel() for p in self.params.values()),
            len(self.fragments),
            cfg.train.inner_steps,
        )
        return cfg

    # -- parameters -----------------------------------------------------------------------------

    def _pull(self, fragments: list[int], wait_s: float, have: list[int] | None) -> list[int]:
        """Take every newer fragment into the model (overwrite) and as the new base; return them."""
        got = self.client.pull(fragments, have, wait_s=wait_s)
        updated = []
        with torch.no_grad():
            for header, tensors in got:
                for name, t in tensors.items():
                    self.params[name].copy_(t.to(self.device))
                    self.base[name] = t.to(torch.float32).clone()
                self.versions[header.fragment] = header.version
                updated.append(header.fragment)
        return updated

    def _delta(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Δ = Θ(base) − θ: the outer gradient this learner proposes for these tensors."""
        with torch.no_grad():
            return {n: self.base[n] - self.params[n].detach().to("cpu", torch.float32) for n in names}

    def _push_round(self, work: RoundWork, wait_for_merge: bool) -> None:
        """Push every fragment's delta for this round; in synchronous DiLoCo wait for the merge."""
        empty = work.steps == 0
        accepted: list[int] = []
        for p, names in enumerate(self.fragments):
            header = pb.TensorHeader(
                fragment=p,
                version=self.versions[p],
                inner_steps=work.steps,
                tokens=work.tokens,
                mean_loss=work.loss_sum / work.steps if work.steps else 0.0,
                first_loss=0.0 if math.isnan(self.progress.first_loss) else self.progress.first_loss,
                step_time_s=self.progress.busy_s / max(1, self.progress.inner_steps),
                codec="fp32",
            )
            if p == 0:  # the data accounting rides on one fragment's push only
                header.spans.extend(
                    pb.ShardSpan(shard_id=s, row_start=a, row_end=b) for s, a, b in work.spans
                )
                header.released_shards.extend(work.released)
            reply = self.client.push(header, {} if empty else self._delta(names))
            if reply.accepted and not empty:
                accepted.append(p)
            elif not reply.accepted:
                log.info("push of fragment %d refused: %s", p, reply.reason)
        for shard_id in work.released:
            self.prefetcher.release(shard_id)
        if not empty:
            log.info(
                "pushed round: steps=%d tokens=%d loss=%.4f versions=%s",
                work.steps,
                work.tokens,
                work.loss_sum / max(1, work.steps),
                self.versions,
            )
        self._await_merge(accepted if wait_for_merge else [])

    def _await_merge(self, pending: list[int]) -> None:
        """Pull fragments until each pushed one is newer than its base (bounded by the run's end)."""
        waiting = set(pending)
        deadline = time.monotonic() + max(120.0, 4 * self.cfg.coordinator.lease_ttl_s)
        while waiting and not self.stop.is_set() and time.monotonic() < deadline:
            order = sorted(waiting)
            updated = self._pull(
                order, wait_s=self.cfg.sync.pull_wait_s, have=[self.versions[p] for p in order]
            )
            waiting -= set(updated)
        # Fragments we did not push (refused, or nothing to push) catch up without waiting.
        everything = list(range(len(self.fragments)))
        self._pull(everything, wait_s=0.0, have=[self.versions[p] for p in everything])

    # -- background -----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        p = self.progress
        reply = self.client.call(
            "Heartbeat",
            pb.HeartbeatRequest(
                shard_leases=self.prefetcher.held_shards(),
                inner_steps=p.inner_steps,
                tokens_trained=p.tokens_trained,
                last_loss=0.0 if math.isnan(p.last_loss) else p.last_loss,
                busy_seconds=p.busy_s,
                wall_seconds=p.wall_s(),
            ),
            timeout_s=10.0,
        )
        if reply.run_state in (pb.RUN_STATE_FINISHING, pb.RUN_STATE_FINISHED):
            self.finishing.set()
        for shard_id in reply.lost_shard_leases:
            log.warning("lease on shard %d lost", shard_id)
            self.prefetcher.release(shard_id)

    def _heartbeat_forever(self, period_s: float) -> None:
        while not self.stop.wait(period_s):
            try:
                self._heartbeat()
            except Exception as e:  # a missed heartbeat is survivable; the next one may land
                log.info("heartbeat failed: %s", e)

    # -- the loop -------------------------------------------------------------------------------

    def _inner_step(self, batch: Batch) -> float:
        started = time.monotonic()
        lr = lr_at(self.progress.inner_steps, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = batch.x.to(self.device, non_blocking=True), batch.y.to(self.device, non_blocking=True)
        _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        value = loss.item()
        if self.step_delay_s > 0:  # an injected straggler, for experiments
            time.sleep(self.step_delay_s)
        p = self.progress
        p.busy_s += time.monotonic() - started
        p.inner_steps += 1
        p.tokens_trained += batch.tokens
        p.last_loss = value
        if math.isnan(p.first_loss):
            p.first_loss = value
        return value

    def run(self) -> int:
        cfg = self._setup()
        self.prefetcher = ShardPrefetcher(
            self.client, cfg.train.batch_size, cfg.data.prefetch_batches, self.stop
        )
        self.prefetcher.start()
        threading.Thread(
            target=self._heartbeat_forever, args=(cfg.coordinator.heartbeat_s,), daemon=True
        ).start()
        self.progress.started = time.monotonic()
        work = RoundWork()
        reason = "stopped"
        try:
            while not self.stop.is_set():
                if self.finishing.is_set():
                    reason = "run finishing"
                    break
                waited = time.monotonic()
                item = self.prefetcher.get(timeout_s=0.5)
                self.progress.stall_s += time.monotonic() - waited
                if item is DONE:
                    reason = "no more data"
                    break
                if item is None:
                    if self.prefetcher.starved.is_set():
                        # Nothing to train on yet: say so (or hand in the partial round) so that a
                        # synchronous round does not wait on us.
                        self._push_round(work, wait_for_merge=work.steps > 0)
                        work = RoundWork()
                    continue
                assert isinstance(item, Batch)
                work.add(item, self._inner_step(item))
                if work.steps >= cfg.train.inner_steps:
                    self._push_round(work, wait_for_merge=True)
                    work = RoundWork()
            if not self.stop.is_set() and work.steps:
                # Finished work is not thrown away: the last partial round is pushed and merged.
                self._push_round(work, wait_for_merge=True)
        finally:
            self.stop.set()
            with contextlib.suppress(Exception):
                self._heartbeat()  # the final counters, for status and utilization
            self.client.leave(reason)
            self.client.close()
        p = self.progress
        log.info(
            "learner done (%s): steps=%d tokens=%d busy=%.1fs wall=%.1fs stall=%.1fs",
            reason,
            p.inner_steps,
            p.tokens_trained,
            p.busy_s,
            p.wall_s(),
            p.stall_s,
        )
        return 0


def run_learner(
    address: str, overrides: LocalOverrides | None = None, stop: threading.Event | None = None
) -> int:
    return Learner(address, overrides, stop).run()
