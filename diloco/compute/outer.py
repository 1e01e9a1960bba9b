"""The learner's side of the outer step, as tensor arithmetic only (no network, no bookkeeping).

delta    Δ_p = Θ_p(base) − θ_p: the outer gradient a learner proposes for fragment p (running
         statistics travel as their values: the coordinator averages those)
encode   quantize + zstd each tensor, keeping what was dropped for the next push (error feedback)
take     θ_p ← α·θ_p + (1−α)·Θ_p; or Θ_p plus the steps taken since the push (keep_overlap)

A merged fragment's value is decoded by diloco.wire.steps, next to the coordinator's encoding.
"""

from __future__ import annotations

import torch

from diloco.compute import schedule
from diloco.config import SyncConfig
from diloco.wire import codecs


def delta(
    base: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    names: list[str],
    values: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Θ(base) − θ for the named tensors, on the CPU in fp32 (what goes on the wire); θ itself for
    those in `values` (running statistics: a delta against an older base would make the
    coordinator's mean of them something else, a variance below zero)."""
    with torch.no_grad():
        return {
            n: params[n].detach().to("cpu", torch.float32, copy=True)
            if n in values
            else base[n] - params[n].detach().to("cpu", torch.float32)
            for n in names
        }


def encode(
    delta: dict[str, torch.Tensor],
    sync: SyncConfig,
    residual: dict[str, torch.Tensor],
    exact: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Each tensor as a uint8 blob of sync.codec; with error feedback, `residual` holds (and is
    updated with) what quantization dropped, sent with the next delta of the same tensor. Those in
    `exact` (running statistics: a layer's variances span 1e-6 to 1e3, and a block's absmax would
    round the small ones to zero) go as fp32 blobs: a few numbers per layer."""
    out = {}
    for name, value in delta.items():
        if name in exact:
            blob = codecs.encode(value, "fp32", sync.codec_level)
        elif sync.error_feedback:
            blob, residual[name] = codecs.encode_with_feedback(
                value, sync.codec, residual.get(name), sync.codec_level
            )
        else:
            blob = codecs.encode(value, sync.codec, sync.codec_level)
        out[name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def take(
    params: dict[str, torch.Tensor],
    value: dict[str, torch.Tensor],
    *,
    alpha: float,
    mixing: bool,
    at_push: dict[str, torch.Tensor] | None,
    exact: frozenset[str] = frozenset(),
) -> None:
    """Write a merged fragment into the learner's parameters: mixed with α (`mixing`: α > 0 and a
    fragment was held before), or with the steps since the push kept on top (`at_push`: θ_p as
    it was at the push), or overwritten; those in `exact` (running statistics) always overwritten:
    the run's mean, never shifted below zero by what moved since."""
    with torch.no_grad():
        for name, t in value.items():
            target = params[name]
            new = t.to(target.device, target.dtype)
            if name in exact:
                target.copy_(new)
            elif mixing:
                target.copy_(schedule.mix(target, new, alpha))
            elif at_push is not None:
                target.add_(new - at_push[name].to(target.device, new.dtype))
            else:
                target.copy_(new)
