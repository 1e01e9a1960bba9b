"""A push's delta as it comes in: received and decoded piece by piece within the bounds its header
declares, judged by its norm (per H steps) against the fragment's parameters and the other
workers' recent deltas, and by its deviation from the fragment's mean step (centered_clip.py),
before the round takes it (pushes.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from diloco.coordinator import centered_clip, delta_sample, limits, pusher_watch
from diloco.coordinator.log_text import loggable
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import FragmentState, log
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire import codecs
from diloco.wire.tensors import TensorAssembler, WireError, sq_norm


@dataclass(frozen=True)
class Screened:
    """What the intake made of a delta before its round takes it."""

    norm_per_h: float = 0.0
    refusal: str = ""  # why it is refused ("": it is not)
    ratio: float | None = None  # its norm over the outlier check's median (the pusher watch's)
    alignment: float | None = None  # its cosine to the fragment's momentum (the pusher watch's)
    loss: float | None = None  # the training loss its learner reported (the pusher watch's)
    deviation_per_h: float | None = None  # from the fragment's mean step (centered_clip)
    kept: float = 1.0  # the share of that deviation it keeps (1: merged as it came)
    clipped: str = ""  # why less than all of it
    momentum: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the momentum it was measured against

    @property
    def watched(self) -> tuple[float | None, float | None, float | None, float | None]:
        """What the ledger keeps of it for the watch and the clip after a restart."""
        return self.ratio, self.alignment, self.deviation_per_h, self.loss


class PushIntake(ServiceBase):
    def _receive_delta(
        self,
        header: pb.TensorHeader,
        names: list[str],
        codec: str,
        messages: Iterator[pb.TensorStreamMessage],
    ) -> tuple[dict[str, torch.Tensor], float | None]:
        """The delta's fp32 tensors: raw for fp32, else one encoded blob per tensor, decoded here;
        and their squared norm when the wire check gave it (fp32), else None."""
        if codec == "fp32":
            expected = {n: self.specs[n] for n in names}
        else:
            expected = None
            blobs = {s.name: s for s in header.tensors}
            if set(blobs) != set(names) or any(
                s.dtype != "uint8" or len(s.shape) != 1 for s in blobs.values()
            ):
                raise WireError(f"a {codec} push carries one 1-D uint8 blob per tensor of the fragment")
            for n, s in blobs.items():  # bounded by what its tensor's shape allows, before any piece
                limit = codecs.max_blob_bytes(self._codec_of(n, codec), math.prod(self.specs[n].shape))
                if s.shape[0] > limit:
                    raise WireError(
                        f"{n}: a {codec} blob of {s.shape[0]} bytes; {limit} at most for its shape"
                    )
        # fp32 values are checked for NaN/inf piece by piece; decoded codecs check their own output.
        asm = TensorAssembler(header, self.config.coordinator.max_push_bytes, expected, finite=True)
        for msg in messages:
            if msg.WhichOneof("kind") != "piece":
                raise WireError("only one header is allowed in a push")
            asm.add(msg.piece)
        received = asm.tensors()
        self.metrics.push_bytes.observe(sum(t.numel() * t.element_size() for t in received.values()))
        if codec == "fp32":
            return received, asm.sq_norm
        decoded = {
            n: codecs.decode(
                received[n].numpy().tobytes(), self._codec_of(n, codec), tuple(self.specs[n].shape)
            )
            for n in names
        }
        return decoded, None

    def _codec_of(self, name: str, codec: str) -> str:
        """How a tensor of a `codec` push is encoded: running statistics always as fp32 blobs (a
        layer's variances span too many orders for a block's absmax: outer.encode)."""
        return "fp32" if name in self.averaged else codec

    def _steps_sq_norm(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """The squared norm of a fragment's tensors that move by steps: running statistics left
        out (they move by the data, not by the learning rate)."""
        return sum(sq_norm(t.float()) for n, t in tensors.items() if n not in self.averaged)

    def _param_norm(self, frag: FragmentState) -> tuple[float, int]:
        """The fragment's parameter norm (running statistics left out) and its entries, computed
        once per version."""
        version, params = frag.version, frag.params
        numel = sum(t.numel() for n, t in params.items() if n not in self.averaged)
        if frag.param_norm[0] != version:
            frag.param_norm = (version, math.sqrt(self._steps_sq_norm(params)))
        return frag.param_norm[1], numel

    def _momentum_norm(
        self, frag: FragmentState, version: int, momentum: Mapping[str, torch.Tensor]
    ) -> float:
        """The norm of the fragment's momentum at `version` (running statistics left out), computed
        once per version."""
        if frag.momentum_norm[0] != version:
            frag.momentum_norm = (version, math.sqrt(self._steps_sq_norm(momentum)))
        return frag.momentum_norm[1]

    def _screen(
        self,
        header: pb.TensorHeader,
        tensors: dict[str, torch.Tensor],
        squared: float | None,
        frag: FragmentState,
    ) -> Screened:
        """The delta's norm per H steps, and why it is refused ("" when it is not): an outlier, or
        (sync.refuse_suspects) its learner named by the pusher watch; refused like a stale push,
        recorded with its reason, its rows left to train. And what the pusher watch saw of it (its
        norm ratio and alignment), its deviation from the fragment's mean step, and how much of
        that deviation it keeps (sync.center_clip)."""
        if squared is None or self.averaged.intersection(tensors):  # decoded, or statistics in it
            squared = self._steps_sq_norm(tensors)
        # A delta of more than H steps (credited by its rows) is compared per H steps; a shorter
        # one as it is (it is smaller, never an outlier for being short).
        steps_over_h = max(1.0, header.inner_steps / self.config.train.inner_steps)
        norm_per_h = math.sqrt(squared) / steps_over_h
        with self.cond:  # appended to under the lock by other pushes: read a copy taken under it
            recent, by = tuple(frag.recent_norms), tuple(frag.recent_workers)
            deviations = tuple(frag.recent_deviations)
            momentum, version = frag.momentum, frag.version
        reference = limits.norm_reference(recent, by, header.worker_id)
        ratio = norm_per_h / reference[0] if reference is not None and reference[0] > 0 else None
        if ratio is not None:
            self.metrics.push_norm_ratio.observe(ratio)
        aligned = delta_sample.alignment(tensors, momentum, self.averaged)
        loss = header.mean_loss if 0 < header.mean_loss < math.inf else None
        self.agreement.add(
            header.worker_id, header.fragment, self.sketcher.sketch(header.fragment, tensors, self.averaged)
        )
        suspect = self._watch_pusher(header.worker_id, ratio, aligned, header.fragment, loss)
        outlier = limits.norm_outlier(
            norm_per_h, recent, self.config.sync.max_delta_norm_ratio, by, header.worker_id
        ) or limits.delta_size_problem(norm_per_h, *self._param_norm(frag))
        if not outlier and suspect and self.config.sync.refuse_suspects:
            outlier = f"{pusher_watch.SUSPECT_REFUSAL}: {suspect}"
        mean_step = (1.0 - self.policy.outer_momentum) * self._momentum_norm(frag, version, momentum)
        deviation = centered_clip.deviation(squared, mean_step, aligned) / steps_over_h
        kept, why = centered_clip.kept_share(
            deviation, deviations, by, header.worker_id, self.config.sync.center_clip
        )
        return Screened(norm_per_h, outlier, ratio, aligned, loss, deviation, kept, why, momentum)

    def _center(self, header: pb.TensorHeader, tensors: dict[str, torch.Tensor], screened: Screened) -> None:
        """A taken delta whose deviation from the fragment's mean step is clipped: pulled toward
        that mean step (outside the lock, before it is folded), counted and logged."""
        centered_clip.pull_toward(
            tensors, screened.momentum, self.policy.outer_momentum, screened.kept, self.averaged
        )
        self.ledger.bump("pushes_center_clipped")
        log.info(
            "push %s of %s clipped: %s", header.push_id[:8], loggable(header.worker_id), screened.clipped
        )

    def _watch_pusher(
        self, worker_id: str, ratio: float | None, alignment: float | None, fragment: int, loss: float | None
    ) -> str:
        """One more push in its learner's watch, and every live learner judged again (a learner's
        direction is judged against the others'); when one comes to look hostile or broken, or no
        longer does, it is logged once; status shows the reason meanwhile. Returns the pusher's
        reason ("": it looks like the others)."""
        sync = self.config.sync
        with self.cond:
            now = self.clock()
            watch = self.pusher_watch.setdefault(worker_id, pusher_watch.PusherWatch())
            watch.add(now, ratio, alignment, fragment, loss)
            judged = pusher_watch.judge(self.pusher_watch, now, *self.watch_bars(), agreement=self.agreement)
            changed = [(w, j.reason) for w, j in judged.items() if self.pusher_watch[w].take(j)]
            reason = watch.suspect
        then = (
            "its pushes refused meanwhile"
            if sync.refuse_suspects
            else "diloco certs revoke, if it is not yours"
        )
        for worker, why in changed:
            if why:
                log.warning("learner %s looks hostile or broken: %s (%s)", loggable(worker), why, then)
            else:
                log.info("learner %s no longer looks hostile or broken", loggable(worker))
        return reason
