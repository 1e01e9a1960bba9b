"""The learner's fragments: merges taken in when due, deltas pushed on the schedule.

    every H/P steps, round-robin: Δ_p = Θ_p(base) − θ_p, with the steps and tokens since Θ_p was
        received and the shard rows trained on -> queued for the background pusher (SyncChannel)
    τ steps after a push, once the merged Θ_p has arrived: θ_p ← α·θ_p + (1−α)·Θ_p, base ← Θ_p

Mixed into the Learner (diloco.compute.learner); when a push or an apply is due are pure functions
of the step count (diloco.compute.schedule), with tests of their own.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable

import torch

from diloco.client import CoordinatorClient
from diloco.compute import outer, replicas, schedule
from diloco.compute.held import HeldFragment
from diloco.compute.prefetch import ShardPrefetcher
from diloco.compute.progress import Progress
from diloco.compute.rows import RowBook, Unpushed, each_row_once
from diloco.compute.state_writer import StateWriter
from diloco.compute.sync_channel import Merged, SyncChannel
from diloco.config import RunConfig
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire import steps

log = logging.getLogger("diloco.learner")


class SyncsFragments:
    """What fragment sync reads and changes of the Learner (declared here)."""

    cfg: RunConfig
    client: CoordinatorClient
    frags: list[HeldFragment]
    params: dict[str, torch.Tensor]
    averaged: frozenset[str]  # the running statistics among params: pushed as values, taken exact
    residual: dict[str, torch.Tensor]
    rows: RowBook
    progress: Progress
    prefetcher: ShardPrefetcher
    channel: SyncChannel
    state_writer: StateWriter | None
    group_live: bool
    data_parallel: replicas.Replicated | replicas.Sharded | None
    schedule_shift: int
    shifted_after: int
    rowless_pushes: int
    _catch_up_after_resume: Callable[[], None]  # a resumed life's lag made up (resume.py)

    def _apply(self, merged: Merged) -> None:
        """Take a merged fragment: θ_p ← α·θ_p + (1−α)·Θ_p, and Θ_p becomes the new base."""
        f = self.frags[merged.fragment]
        if not merged.accepted:
            # The ledger counts row-less pushes back to its last recorded push with rows, and a
            # refused push is not recorded: ours may be P − 1 already (seen after a partition: two
            # pushes with rows refused, then a row-less one refused too).
            self.rowless_pushes = max(self.rowless_pushes, len(self.frags) - 1)
        alpha = self.cfg.sync.mix_alpha
        value, version = self._merged_value(f, merged)
        keep = alpha == 0 and self.cfg.sync.keep_overlap and bool(f.at_push)
        if self.group_live and (alpha > 0 or keep):  # the mix reads what we trained since
            self.data_parallel.refresh(merged.fragment, f.names, self.params)
        outer.take(
            self.params,
            value,
            alpha=alpha,
            mixing=alpha > 0 and f.version >= 0,
            at_push=f.at_push if keep else None,
            exact=self.averaged,
        )
        f.base = {**f.base, **{n: t.to(torch.float32).clone() for n, t in value.items()}}
        f.version = version
        f.in_flight = False
        f.push = None
        if keep:  # the steps since the push are still ours to push, with the rows they trained on
            steps, tokens, loss_sum = f.counted_at_push
            f.steps, f.tokens, f.loss_sum = f.steps - steps, f.tokens - tokens, f.loss_sum - loss_sum
        else:
            f.steps = f.tokens = 0
            f.loss_sum = 0.0
            self.rows.overwritten(merged.fragment)  # its waiting rows ride on the next push
        f.at_push = {}
        if self.group_live:  # every rank writes the same values before its next step
            self.data_parallel.write(merged.fragment, f.names, self.params)
            self.progress.replica_checks += 1

    def _merged_value(self, f: HeldFragment, merged: Merged) -> tuple[dict[str, torch.Tensor], int]:
        """The fragment's new value and version; steps that do not follow what we hold are not
        applied: the fragment is pulled whole instead."""
        value = steps.decode_steps(f.base, f.version, merged.parts)
        if value is not None:
            return value, merged.version
        log.warning(
            "fragment %d: steps from %d do not follow version %d; pulling it whole",
            merged.fragment,
            merged.parts[0][0].version,
            f.version,
        )
        (header, tensors), *_ = self.client.pull([merged.fragment], None)
        return tensors, header.version

    def _apply_due(self) -> None:
        step = self.progress.inner_steps
        for p, f in enumerate(self.frags):
            if f.in_flight and schedule.apply_due(step, f.apply_at):
                merged = self.channel.take(p)
                if merged is not None:
                    self._apply(merged)

    def _push(self, p: int, empty: bool = False) -> None:
        """Queue fragment p's delta (and the unpushed shard rows) for the background pusher."""
        f = self.frags[p]
        header = pb.TensorHeader(
            fragment=p,
            version=f.version,
            # The run's codec even when empty: the coordinator refuses any other label (an int8 run's
            # empty pushes labelled fp32 were refused, and a quorum-2 round waited for them forever).
            codec=self.cfg.sync.codec,
            inner_steps=0 if empty else f.steps,
            tokens=0 if empty else f.tokens,
            mean_loss=f.loss_sum / f.steps if f.steps and not empty else 0.0,
            first_loss=0.0 if math.isnan(self.progress.first_loss) else self.progress.first_loss,
            step_time_s=self.progress.step_time_s(),
            push_id=uuid.uuid4().hex,  # here, not in the client: the local state keeps it
        )
        tensors: dict[str, torch.Tensor] = {}
        if not empty:
            if self.group_live:  # FSDP: the shards' values into rank 0's whole copy
                self.data_parallel.refresh(p, f.names, self.params)
            tensors = outer.delta(f.base, self.params, f.names, self.averaged)
            if header.codec != "fp32":
                tensors = outer.encode(tensors, self.cfg.sync, self.residual, self.averaged)
            carried = self._covered_by(p)
            header.spans.extend(
                pb.ShardSpan(shard_id=s, row_start=a, row_end=b) for s, a, b in each_row_once(carried.spans)
            )
            header.released_shards.extend(carried.released)
            for shard_id in carried.released:
                self.prefetcher.release(shard_id)
            f.in_flight = True
            f.apply_at = self.progress.inner_steps + self.cfg.sync.overlap_steps
            if self.cfg.sync.keep_overlap and self.cfg.sync.overlap_steps:
                f.at_push = {n: self.params[n].detach().clone() for n in f.names}
                f.counted_at_push = (f.steps, f.tokens, f.loss_sum)
            f.push = (header, tensors)
            if self.state_writer is not None:
                self.state_writer.note_push(header, tensors)
        self.channel.submit(header, tensors)

    def _covered_by(self, p: int) -> Unpushed:
        """The rows whose effect is in every fragment once fragment p is pushed now, or every row
        held when that is none and the coordinator would refuse another push that names none."""
        fragments = len(self.frags)
        carried = self.rows.carry(p, fragments, self.progress.busy_s)
        if not carried.spans and self.rowless_pushes >= fragments - 1 and self.rows.spans():
            # At most P − 1 pushes in a row may name no rows (ledger/claims.py). A hand-in's last
            # pushes name none (its first names every row), and so do the first of the schedule
            # when training goes on after it, or a fragment's pushes while another's push waits
            # long for its merge: the rows held ride now, their cover completing after them (as
            # in a hand-in) instead of the push being refused, its steps with it.
            self.rows.hand_in()
            carried = self.rows.carry(p, fragments, self.progress.busy_s)
        self.rowless_pushes = 0 if carried.spans else self.rowless_pushes + 1
        if self.rows.all_carried():  # every step so far rides on a push: a kill now loses none of it
            self.progress.kept_busy_s = self.progress.busy_s
        else:  # the steps before the rows that still wait for another fragment's push
            self.progress.kept_busy_s = max(self.progress.kept_busy_s, self.rows.kept_busy_s)
        return carried

    def _push_due(self) -> None:
        self._catch_up_after_resume()
        p = schedule.fragment_due(
            self.progress.inner_steps + self.schedule_shift, self.cfg.train.inner_steps, len(self.frags)
        )
        if p is None:
            return
        # At a push: the next one is a whole interval away, so bringing the schedule forward by
        # less than that skips none.
        interval = schedule.push_interval(self.cfg.train.inner_steps, len(self.frags))
        missed = self.channel.take_missed(self.shifted_after)
        shift = schedule.catch_up_steps(missed, self.progress.step_time_s(), interval)
        if shift:
            log.info("pushes missed the others' rounds: pushing %d step(s) earlier from now on", shift)
            self.schedule_shift += shift
            self.shifted_after = self.channel.submitted
        if self.frags[p].in_flight:
            # The last merge of this fragment has not come back yet: keep training, push it next time.
            log.info(
                "fragment %d still in flight at step %d; skipping its push", p, self.progress.inner_steps
            )
            return
        if not self.frags[p].steps:
            return  # received this very step: nothing of ours in it yet
        self._push(p)
