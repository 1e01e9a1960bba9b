"""The learner's local state, kept and resumed (diloco.compute.local_state has the file and the
decision): a copy of what it holds every few seconds, handed to a writer thread; after a restart,
that copy put back in place of a full pull when the run still accepts it, with the pushes made
after it replayed from the push journal (diloco.compute.push_journal)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from functools import partial

import torch

from diloco.client import CoordinatorClient
from diloco.compute import local_state, push_journal, schedule
from diloco.compute.held import HeldFragment
from diloco.compute.local_state import LocalState, state_path
from diloco.compute.overrides import LocalOverrides
from diloco.compute.prefetch import ShardPrefetcher
from diloco.compute.progress import Progress
from diloco.compute.replicas import Replicated, Sharded
from diloco.compute.rows import RowBook, span_tokens
from diloco.compute.state_writer import StateWriter
from diloco.compute.sync_channel import SyncChannel
from diloco.config import RunConfig
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.learner")

# A resumed life's steps before its lag is measured with its own step time, when its state has
# none (an older file): the first step is slow (warm-up), and the lag in steps comes out short.
RESUME_LAG_AFTER_STEPS = 3


@dataclasses.dataclass
class ResumeLag:
    """What a resumed life's push schedule still has to make up (_catch_up_after_resume)."""

    copied_at: float  # the wall clock of the copy it resumed
    step_time_s: float  # the dead life's at the copy (0: unknown; this life's own is used)
    made: int  # steps the schedule moved past the push points of the journal's pushes
    behind: int | None = None  # the steps still to move, once measured


class KeepsLocalState:
    """Mixed into the Learner: what it holds (declared here) is what the local state copies."""

    client: CoordinatorClient
    overrides: LocalOverrides
    device: torch.device
    params: dict[str, torch.Tensor]  # parameters and running statistics (contract.synced_tensors)
    optimizer: torch.optim.Optimizer
    frags: list[HeldFragment]
    residual: dict[str, torch.Tensor]
    rows: RowBook
    row_tokens: dict[int, int]  # shard id -> what one of its rows counts for
    progress: Progress
    schedule_shift: int
    run_id: str
    resume_reason: str
    prefetcher: ShardPrefetcher
    channel: SyncChannel
    state_writer: StateWriter | None
    stop: threading.Event
    data_parallel: Replicated | Sharded | None  # a torchrun group's (None: one process)
    shifted_after: int
    resume_lag: ResumeLag | None  # a resumed life's push schedule still to bring forward (None: none)

    def _resume_decision(self, cfg: RunConfig, reply: pb.JoinReply) -> LocalState | None:
        """This learner's state from its last life, restored, when the run still accepts it; else None."""
        if not self.overrides.state_dir or not self.overrides.worker_id or cfg.train.local_state_every_s <= 0:
            return None
        path = state_path(self.overrides.state_dir, self.overrides.worker_id)
        self.state_writer = StateWriter(
            path, cfg.train.local_state_every_s, self._saved, cfg.train.local_state_max_share
        )
        state = local_state.load(path, [f.names for f in self.frags])
        journal = push_journal.after(path, state.push_count) if state is not None else []
        decision = local_state.resume_decision(
            state,
            run_id=reply.run_id,
            worker_id=self.client.worker_id,
            shapes={n: tuple(p.shape) for n, p in self.params.items()},
            current_versions=list(reply.fragment_versions),
            max_staleness=cfg.sync.max_staleness,
            pushes_noted=local_state.pushed_count(path),
            journaled=tuple(push.header.fragment for push in journal),
        )
        if state is not None:
            log.info("local state: %s", decision.reason)
            self.resume_reason = decision.reason
        if not decision.resume or state is None:
            self.state_writer.start_fresh()
            return None
        pushed = push_journal.replay(state, journal, keeps_overlap=keeps_overlap(cfg))
        with torch.no_grad():
            for name, t in state.params.items():
                self.params[name].copy_(t.to(self.device))
        self.optimizer.load_state_dict(state.optimizer)
        self.frags = state.fragments
        self.residual = state.residual
        self.rows = state.rows
        self.row_tokens.update(state.row_tokens)  # the rows it resumes count in its claims at once
        self.progress.inner_steps = state.inner_steps
        self.progress.first_loss = state.first_loss
        # The dead life's kept time at this copy, for the coordinator to count once: its last
        # heartbeat may have come before the copy (this life's own time starts from 0).
        self.progress.resumed_kept_busy_s = state.busy_s
        # The push points the journal's pushes were made at are behind this life too.
        jump = schedule.past_replayed_pushes(
            state.inner_steps + state.schedule_shift,
            [push.header.fragment for push in journal],
            cfg.train.inner_steps,
            len(self.frags),
        )
        self.schedule_shift = state.schedule_shift + jump
        if not cfg.sync.synchronous:  # synchronous rounds line learners up by themselves
            self.resume_lag = ResumeLag(state.written_at, state.step_time_s, jump)
        for p, push in state.pushes.items():
            self.frags[p].push = push
        if pushed:  # their steps went with the journaled pushes: they start over from the run's
            self._start_over(self.client.pull(sorted(pushed), None), cfg)
        log.info(
            "local state: the last life's unmerged rows count %d tokens in this life's claim on the budget",
            span_tokens(self.rows.spans(), self.row_tokens),
        )
        return state

    def _start_over(
        self, pulled: list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]], cfg: RunConfig
    ) -> None:
        """Fragments a journaled push carried: the run's current value in place of the state's
        (which the push holds already), still in flight with that push. With keep_overlap the steps
        from here on are kept on top of its merge, as after any push."""
        for header, value in pulled:
            f = self.frags[header.fragment]
            with torch.no_grad():
                for n in f.names:
                    self.params[n].copy_(value[n].to(self.device))
            f.base = {n: value[n].to(torch.float32).clone() for n in f.names}
            f.version = header.version
            f.steps = f.tokens = 0
            f.loss_sum = 0.0
            f.apply_at = self.progress.inner_steps + cfg.sync.overlap_steps
            f.at_push = {n: self.params[n].detach().clone() for n in f.names} if keeps_overlap(cfg) else {}
            f.counted_at_push = (0, 0, 0.0)
            for n in f.names:  # what the codec left out was sent on with the journaled push
                self.residual.pop(n, None)

    def _catch_up_after_resume(self) -> None:
        """Before each push check of a resumed life: bring the push schedule forward by the steps
        that died with the last life (schedule.resume_lag_steps), measured at its first check, and
        moved without skipping a push due (schedule.advance_now)."""
        lag = self.resume_lag
        if lag is None:
            return
        step_time = lag.step_time_s or self.progress.step_time_s()
        if self.progress.life_steps < (1 if lag.step_time_s else RESUME_LAG_AFTER_STEPS):
            return
        interval = schedule.push_interval(self.cfg.train.inner_steps, len(self.frags))
        if lag.behind is None:
            since = time.time() - lag.copied_at
            made = self.progress.life_steps + lag.made
            lag.behind = schedule.resume_lag_steps(since, made, step_time, interval)
            if lag.behind:
                log.info(
                    "resumed %d step(s) behind the other learners (state copied %.1fs ago): "
                    "pushing that much earlier from now on",
                    lag.behind,
                    since,
                )
        take = schedule.advance_now(lag.behind, self.progress.inner_steps + self.schedule_shift, interval)
        if take:
            self.schedule_shift += take
            lag.behind -= take
            # What the coordinator says of pushes made before the move measured the old schedule.
            self.shifted_after = self.channel.submitted
        if not lag.behind:
            self.resume_lag = None

    def _saved(self, state: LocalState) -> None:
        """(writer thread) The steps up to this state survive a kill now."""
        self.progress.kept_busy_s = max(self.progress.kept_busy_s, state.busy_s)

    def _resume_in_flight(self, state: LocalState) -> None:
        """After a resume: the last life's shard leases go back to the pool (their rows trained and
        unmerged ride on our pushes; the prefetcher never cuts them again), and each push that was
        in flight is sent again with its own push_id, for the ledger to answer. This life leases
        nothing before all of that is answered. (Called before the prefetcher and the channel start.)"""
        self.prefetcher.skip(state.row_spans())
        # The pushes first, the leases after: the channel sends in order, so a shard given back is
        # leased again only once these pushes' rows are recorded, and its rows still to train leave
        # them out. The other way round, a resumed life re-leased its shard between the two and
        # trained a replayed push's rows again (its state no longer lists them), and its next two
        # pushes were refused as re-sent work (a chaos run: two rounds of one push).
        sent = False
        for f in self.frags:
            if f.in_flight and f.push is not None:
                self.channel.submit(*f.push)
                sent = True
            elif f.in_flight:  # nothing to ask about: take the fragment's next version as it comes
                f.in_flight = False
        if state.held_shards:
            # release_only: an empty push would say "nothing from me this round", and the round
            # would close on the other learners' pushes alone (measured: a chaos run's round of
            # one push at coverage 1/2, closed as "every live learner pushed" 2 s after a resume).
            header = pb.TensorHeader(
                fragment=0,
                version=max(0, self.frags[0].version),
                codec=self.cfg.sync.codec,
                release_only=True,
            )
            header.released_shards.extend(state.held_shards)
            self.channel.submit(header, {})
            sent = True
        if sent:
            # The ledger gives leases back by shard id and worker id alone, and this life has the
            # last life's worker id: a release that lands after this life leased the same shard
            # takes the new lease. A SIGTERM's Leave had freed the shards already, the new life
            # leased its old shard at once (first in lease order), the release then took it, the
            # shard was leased again with rows trained under the first lease still unrecorded, and
            # the two pushes carrying them twice were refused as re-sent work (an operator's run:
            # ~100 steps lost). So the first lease waits until these pushes have their answers:
            # the release can only give back what the last life held (or nothing, after a Leave),
            # and a shard leased from then on leaves the replayed pushes' rows out.
            self.prefetcher.lease_after(partial(answered_all, self.channel))
            log.info("local state: no shard leased before the last life's pushes and leases are answered")

    def _keep_local_state(self) -> None:
        """A copy of what this learner holds, for the writer thread to save (local_state)."""
        writer = self.state_writer
        if writer is None or not writer.due(time.monotonic()):
            return
        started = time.monotonic()
        # A torchrun group's: under FSDP the trained values live in the ranks' shards, gathered here.
        dp = self.data_parallel
        optimizer = dp.optimizer_copy(self.params) if dp else local_state.copy_optimizer(self.optimizer)
        # The tensors in bases and pushes are replaced, never changed in place: the dicts are copied.
        frags = [dataclasses.replace(f, base=dict(f.base), at_push=dict(f.at_push)) for f in self.frags]
        rows, held = self.rows.copy(), self.prefetcher.held_shards()
        pushes = {p: f.push for p, f in enumerate(self.frags) if f.in_flight and f.push is not None}
        named = {sid for sid, _, _ in rows.spans()} | set(held)
        named |= {s.shard_id for header, _ in pushes.values() for s in header.spans}
        state = LocalState(
            run_id=self.run_id,
            worker_id=self.client.worker_id,
            inner_steps=self.progress.inner_steps,
            busy_s=self.progress.busy_s,
            first_loss=self.progress.first_loss,
            schedule_shift=self.schedule_shift,
            step_time_s=self.progress.step_time_s(),
            params={n: p.detach().to("cpu", copy=True) for n, p in self.params.items()},
            optimizer=optimizer,
            fragments=frags,
            pushes=pushes,
            residual=dict(self.residual),
            rows=rows,
            held_shards=held,
            push_count=writer.push_count,
            row_tokens={sid: n for sid in named if (n := self.row_tokens.get(sid)) is not None},
        )
        writer.offer(state, copy_s=time.monotonic() - started)


def answered_all(channel: SyncChannel) -> bool:
    """Every push submitted to the channel so far has its answer (or was given up, the learner
    stopping). Exact from any thread: a job counts from the moment it is queued until its answer,
    so a push submitted before this is asked can never look answered before it is."""
    return channel.jobs.unfinished_tasks == 0


def keeps_overlap(cfg: RunConfig) -> bool:
    """A merge's apply keeps the steps since its push (fragment_sync._apply)."""
    return cfg.sync.mix_alpha == 0 and cfg.sync.keep_overlap and cfg.sync.overlap_steps > 0
