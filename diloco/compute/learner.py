"""The learner: inner AdamW steps on its own; fragments of its progress go to the syncer.

    join -> (init) -> pull every fragment Θ_p -> loop:
        one inner step on a prefetched batch        (the only thing a learner waits on is data)
        every H/P steps, round-robin: Δ_p = Θ_p(base) − θ_p, with the steps and tokens since Θ_p
            was received and the shard rows trained on -> pushed by a background thread
        τ steps after a push, once the merged Θ_p has arrived: θ_p ← α·θ_p + (1−α)·Θ_p, base ← Θ_p

With τ = 0 the learner waits for each merge: synchronous DiLoCo (with P = 1 and quorum = all).
A learner may be a torchrun group (diloco.compute.group): this class is its rank 0, the only one
that talks to the coordinator; the inner loop is plain PyTorch (DDP or FSDP2 inside a group).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch

from diloco.client import WORKER_OUTAGE_TOLERANCE_S, CoordinatorClient
from diloco.clock import lasting
from diloco.compute import group as ranks
from diloco.compute import replicas, schedule
from diloco.compute.batch import Batch
from diloco.compute.endgame import STARVED_PATIENCE_S, EndGame
from diloco.compute.fragment_sync import SyncsFragments
from diloco.compute.handshake import check_same_model, join_run, pull_everything
from diloco.compute.heartbeats import Heartbeats
from diloco.compute.held import HeldFragment
from diloco.compute.inner import inner_step, straggle_s
from diloco.compute.local_state import LocalState
from diloco.compute.mfu import peak_flops
from diloco.compute.overrides import LocalOverrides
from diloco.compute.prefetch import DONE, ShardPrefetcher
from diloco.compute.progress import Progress
from diloco.compute.resume import KeepsLocalState, ResumeLag
from diloco.compute.rows import RowBook
from diloco.compute.startup import StartupClock, breakdown, describe
from diloco.compute.state_writer import StateWriter
from diloco.compute.sync_channel import Merged, SyncChannel
from diloco.config import RunConfig
from diloco.data.cache import open_cache
from diloco.errors import DilocoError
from diloco.role import heartbeat_thread, refusing
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")


class Learner(SyncsFragments, KeepsLocalState, EndGame, Heartbeats):
    def __init__(
        self,
        address: str,
        overrides: LocalOverrides | None = None,
        stop: threading.Event | None = None,
        group: ranks.Group | None = None,
    ):
        self.startup = StartupClock.from_env()
        self.startup.mark("imports")
        self.overrides = overrides or LocalOverrides()
        # The torchrun group this process leads (None: a learner of one process). The other
        # ranks follow it from the first shared parameters (group_live) to the stop.
        self.group, self.group_live = group, False
        self.data_parallel: replicas.Replicated | replicas.Sharded | None = None  # set with the group
        self.client = CoordinatorClient(
            address,
            pb.ROLE_COMPUTE,
            retry_deadline_s=WORKER_OUTAGE_TOLERANCE_S,
            worker_id=self.overrides.worker_id,
        )
        self.client.ranks = group.world if group else 1
        self.stop = stop or threading.Event()
        self.finishing = threading.Event()
        self.progress = Progress()
        self.rows = RowBook()  # the shard rows trained on that no merge has counted yet
        self.rowless_pushes = 0  # this life's pushes in a row that named no rows (fragment_sync)
        self.row_tokens: dict[int, int] = {}  # shard id -> what one of its rows counts for (tokens)
        # A Decoupled run's token budget: (tokens_trained reported, tokens allowed past it) from
        # the last heartbeat; None: no limit (lifecycle.training_allowance).
        self.allowance: tuple[int, int] | None = None
        self.frags: list[HeldFragment] = []
        self.residual: dict[str, torch.Tensor] = {}  # error feedback: what quantization dropped
        self.averaged: frozenset[str] = frozenset()  # running statistics among params (set at join)
        # Steps the push schedule runs ahead of the step count: moved on when our pushes keep
        # missing the other learners' rounds (SyncChannel.take_missed).
        self.schedule_shift = 0
        self.state_writer: StateWriter | None = None  # local state kept on disk (local_state)
        self.resumed: LocalState | None = None
        self.resume_reason = ""  # why the local state was resumed or not ("" when none is kept)
        self.shifted_after = 0  # pushes up to this number were made before the last move
        self.resume_lag: ResumeLag | None = None  # a resumed life's push schedule to bring forward
        # A user's own model and optimizer (own_loop.connect); None: built from model.factory.
        self.own: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def _setup(self) -> RunConfig:
        o = self.overrides
        if self.group is not None and self.own is not None:
            raise DilocoError("your own training loop runs DDP itself: connect it from one process")
        joined = join_run(
            self.client, connect_timeout_s=o.connect_timeout_s, device=o.device, threads=o.threads,
            mark=self.startup.mark, own=self.own, place=self.group.device_for if self.group else None,
        )  # fmt: skip
        reply, cfg = joined.reply, joined.cfg
        self.epoch, self.run_id = reply.coordinator_epoch, reply.run_id
        self.cfg, self.device = cfg, joined.device
        self.progress.device = str(joined.device)
        self.model, self.optimizer, self.params, self.frags = (
            joined.model,
            joined.optimizer,
            joined.params,
            joined.frags,
        )
        self.averaged = joined.averaged
        self.resumed = self._resume_decision(cfg, reply)
        if cfg.train.max_tokens and not cfg.sync.synchronous:  # a budget: no step before an allowance
            self.allowance = (self.progress.tokens_trained, 0)
        if self.resumed is None:
            pulled = pull_everything(self.client, len(self.frags), cfg, o.connect_timeout_s, self.stop)
            with refusing(self.client, log):
                check_same_model(
                    self.params,
                    {n: t for _, ts in pulled for n, t in ts.items()},
                    "your own" if self.own else cfg.model.factory,
                )
            for header, tensors in pulled:
                self._apply(Merged.full(header.fragment, header.version, tensors))
        self.train_model = self.model
        if self.group is not None:  # DDP or FSDP inside: what trains, and with which optimizer
            self.data_parallel = replicas.lead(o.data_parallel, self.group, reply.config_json, cfg.train,
                                      self.model, self.optimizer, self.device)  # fmt: skip
            self.train_model, self.optimizer = self.data_parallel.train_model, self.data_parallel.optimizer
            self.group_live = True
        if cfg.train.compile:  # the wrapper shares the parameters; names stay the model's own
            self.train_model = torch.compile(self.train_model)
        self.progress.ranks = self.group.world if self.group else 1
        self.progress.params = sum(
            p.numel() for p in self.model.parameters()
        )  # (for MFU: not the statistics)
        self.progress.peak_flops = peak_flops(self.device)
        self.startup.mark("pull")
        log.info(
            "learner %s on %s: %d params in %d fragment(s), H=%d, tau=%d, versions %s",
            self.client.worker_id, self.device, self.progress.params, len(self.frags),
            cfg.train.inner_steps, cfg.sync.overlap_steps, [f.version for f in self.frags],
        )  # fmt: skip
        return cfg

    def _wait_if_unreachable(self) -> None:
        started = time.monotonic()
        while schedule.must_block(self.channel.unreachable_for(), self.cfg.sync.max_unreachable_s):
            if self.stop.wait(0.5):
                break
        self.progress.sync_wait_s += time.monotonic() - started

    # -- the loop -------------------------------------------------------------------------------

    def _inner_step(self, batch: Batch) -> None:
        started = time.monotonic()
        step, columns = self.progress.inner_steps, batch.columns
        if self.group_live:  # every rank trains on its part of the batch
            columns = self.group.send_batch(columns, step)
        loss, metrics = inner_step(
            self.train_model, self.optimizer, columns,
            step=step, train=self.cfg.train, device=self.device,
            where=f"model.factory {self.cfg.model.factory}",
        )  # fmt: skip
        if self.group_live:
            loss = self.group.mean(loss)
        o = self.overrides
        pause = straggle_s(
            time.monotonic() - started, slow_factor=o.slow_factor, step_delay_s=self.cfg.train.step_delay_s
        )
        if pause:
            time.sleep(pause)
        self._stepped(batch, loss, time.monotonic() - started, metrics)

    def _stepped(self, batch: Batch, loss: float, seconds: float, metrics: dict[str, float]) -> None:
        """Count one inner step on `batch`: its tokens and loss go to every fragment's next push,
        its rows to the push that carries them."""
        self.progress.stepped(seconds, batch.tokens, loss, metrics)
        for f in self.frags:
            f.steps += 1
            f.tokens += batch.tokens
            f.loss_sum += loss
        self.rows.trained(batch)
        for span in batch.spans:
            self.row_tokens[span.shard_id] = batch.per_row(span)

    def _next_batch(self) -> Batch | object | None:
        """The next batch (DONE: no more data; None: none yet), time stalled on data counted."""
        ready = self.prefetcher.ready()
        waited = time.monotonic()
        item = self.prefetcher.get(timeout_s=0.5)
        # A stall is waiting with no batch ready, not a thread hand-off; the wait for this life's
        # first batch is start-up (startup.marks), as is the time before it: not in the wall.
        if not ready and self.progress.life_steps:
            self.progress.stall_s += time.monotonic() - waited
        return item

    def _steps(self) -> Iterator[Batch]:
        """The loop around the training step: yields each batch to train on, and between two
        batches applies the merges due, pushes the fragment due, keeps the local state. The step
        itself is the caller's (`_train`, or the user's own loop). Sets `ended_because`."""
        cfg, last_empty_push = self.cfg, 0.0
        starved_since: float | None = None
        item: Batch | object | None = None
        while True:
            # The coordinator refusing this learner for good (a rotated token or certificate) ends
            # it here, with that line: training on would only make pushes nobody merges.
            self.channel.check()
            reason = schedule.loop_end(
                stopped=self.stop.is_set(),
                finishing=self.finishing.is_set() or self.channel.finishing.is_set(),
                no_more_data=item is DONE,
                share_done=schedule.share_done(self.progress.tokens_trained, cfg),
            )
            if reason is not None:
                self.ended_because = reason
                return
            if schedule.budget_spent(self.progress.tokens_trained, self.allowance):
                last_empty_push = self._wait_for_allowance(last_empty_push)
                continue
            item = self._next_batch()
            if item is None:  # none ready yet
                starved_since, starved_s = lasting(
                    self.prefetcher.starved.is_set(), starved_since, time.monotonic()
                )
                if starved_since is not None:
                    last_empty_push = self._on_starved(last_empty_push, starved_s >= STARVED_PATIENCE_S)
                self._apply_due()
                continue
            starved_since = None
            if not isinstance(item, Batch):
                continue  # DONE: the loop ends above
            first = not self.progress.tokens_trained  # this life's first step (a resume goes on counting)
            if first:
                self.startup.mark("first_batch")
                self.progress.start()  # training time, utilization's wall, from here
            yield item
            if first:
                self.startup.mark("first_step")
                log.info("%s", describe(breakdown(self.startup.marks)))
            self._apply_due()
            self._push_due()
            if cfg.sync.synchronous:
                self._wait_for_merges()
            self._keep_local_state()
            self._wait_if_unreachable()

    def _train(self) -> str:
        """The loop: one inner step on each batch. Returns why it ended."""
        for batch in self._steps():
            self._inner_step(batch)
        return self.ended_because

    def _start(self) -> threading.Thread:
        """Start the background parts: prefetching, pushing and pulling, heartbeats."""
        cfg = self.cfg
        self.prefetcher = ShardPrefetcher(
            self.client, cfg.train.batch_size, cfg.data.prefetch_batches, self.stop,
            cache=open_cache(cfg.data.cache_dir, cfg.data.cache_bytes), mix=cfg.data.mix_shards,
            seed=cfg.train.seed, pin_memory=self.device.type == "cuda",
        )  # fmt: skip
        self.channel = SyncChannel(
            self.client, self.stop, cfg.sync.pull_wait_s, lambda p: self.frags[p].version
        )
        self.prefetcher.leave_out(self._unmerged_spans)
        if self.resumed is not None:
            self._resume_in_flight(self.resumed)
        self.prefetcher.start()
        self.channel.start()
        heartbeats = heartbeat_thread(self._heartbeat, cfg.coordinator.heartbeat_s, self.stop, log)
        self.progress.start()
        return heartbeats

    def run(self) -> int:
        try:
            self._setup()
        except BaseException:
            if self.group is not None and not self.group_live:  # the other ranks wait for the run
                self.group.no_run()
            raise
        heartbeats = self._start()
        try:
            reason = self._train()
            self._stop_group()
        except DilocoError as error:  # the model broke the contract (no loss): one line, and out
            self.group_live = False
            log.error("%s", error)
            self._leave(f"refused: {error}", heartbeats)
            raise
        except BaseException:
            # No stop to the other ranks: they may be inside a step's collective; this rank's
            # exit makes torchrun take the group down.
            self.group_live = False
            self._leave("stopped", heartbeats)
            raise
        self._hand_in_and_leave(reason, heartbeats)
        return 0

    def _stop_group(self) -> None:
        """The other ranks exit once the loop ends: the hand-in after it is rank 0's alone."""
        if self.group_live:
            for p, f in enumerate(self.frags):  # the hand-in's pushes read rank 0's copy
                self.data_parallel.refresh(p, f.names, self.params)
            self.group_live = False
            self.group.stop()
