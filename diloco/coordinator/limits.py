"""Bounds on what a caller may send: pure checks, each returning why a value is refused ("" when
it is fine). Without them one bad (or hostile) call could poison the run for good: a finite but
huge delta with a huge token count merged into inf parameters, 2^62 tokens overflowed the
ledger's sums, a 3 MB worker id made every Status reply exceed the message limit."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import torch

from diloco.config import RunConfig
from diloco.v1 import coordinator_pb2 as pb

MAX_ID_BYTES = 256
MAX_NAME_BYTES = 64  # a training metric's name: MAX_METRICS ride on every heartbeat and status
MAX_METRICS = 32
MAX_TEXT_BYTES = 4096  # error texts and reasons kept (longer ones are cut)
# Integers that reach SQLite or a float: far above any real run, far below int63 and float's 2^53.
MAX_COUNT = 1 << 50
# A push's inner steps since its base: H per push, more after an outage or a stall, never this many.
MAX_STEPS_PER_H = 1000
# Ranks one learner may say it has (a torchrun group), for status.
MAX_RANKS = 4096
# A completed shard the coordinator reads back to check it: a 64 MiB raw chunk makes ~30 MB.
MAX_SHARD_BYTES = 1 << 30


def id_problem(value: str, what: str = "worker id", limit: int = MAX_ID_BYTES) -> str:
    if len(value.encode()) > limit:
        return f"{what} is longer than {limit} bytes"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"{what} holds control characters"
    return ""


def numbers_problem(values: Iterable[tuple[str, float]]) -> str:
    """Counters and times: finite, in [0, MAX_COUNT]."""
    for name, value in values:
        if not math.isfinite(value) or not 0 <= value <= MAX_COUNT:
            return f"{name} = {value!r} is not a count in [0, 2^50]"
    return ""


def heartbeat_problem(request: pb.HeartbeatRequest) -> str:
    fields = ("inner_steps", "tokens_trained", "busy_seconds", "kept_busy_seconds", "wall_seconds",
              "data_stall_seconds", "sync_wait_seconds", "tokens_unmerged", "pull_seconds",
              "pulled_fragments", "cpu_seconds", "budget_wait_seconds", "resumed_kept_busy_seconds")  # fmt: skip
    problem = numbers_problem((f, float(getattr(request, f))) for f in fields)
    if problem:
        return problem
    if not math.isfinite(request.last_loss):
        return "last_loss is not finite"
    if len(request.train_metrics) > MAX_METRICS or any(
        not math.isfinite(v) for v in request.train_metrics.values()
    ):
        return f"train_metrics: at most {MAX_METRICS}, all finite"
    if problem := ranks_problem(request.ranks):
        return problem
    if not math.isfinite(request.mfu) or not 0 <= request.mfu <= 1e3:
        return f"mfu = {request.mfu!r} is not a finite share"
    if any(id_problem(k, "a metric's name", MAX_NAME_BYTES) for k in request.train_metrics) or id_problem(
        request.device, "device"
    ):
        return "train_metrics names and device: short, no control characters"
    return ""


def ranks_problem(ranks: int) -> str:
    return "" if 0 <= ranks <= MAX_RANKS else f"ranks {ranks} is not in [0, {MAX_RANKS}]"


def push_problem(header: pb.TensorHeader, cfg: RunConfig) -> str:
    """A delta's claims, bounded: its steps by H, its tokens by what that many batches can hold,
    its losses and step time finite. (Its rows are checked by the ledger against its spans.)"""
    h, batch, row = cfg.train.inner_steps, cfg.train.batch_size, cfg.model.seq_len + 1
    if not 1 <= header.inner_steps <= MAX_STEPS_PER_H * h:
        return f"inner_steps {header.inner_steps} is not in [1, {MAX_STEPS_PER_H} × H]"
    if not 1 <= header.tokens <= header.inner_steps * batch * row:
        return f"tokens {header.tokens} is more than {header.inner_steps} steps of {batch} rows of {row} tokens hold"
    for name in ("mean_loss", "first_loss", "step_time_s"):
        value = getattr(header, name)
        if not math.isfinite(value) or value < 0:
            return f"{name} = {value!r} is not a finite, non-negative number"
    return ""


MIN_NORM_HISTORY = 4
# A delta's norm per H steps against its fragment's parameter norm, whatever the history (a
# fragment's first pushes, after a start or a restart, have none). Honest deltas measured, ‖Δ‖ per
# H steps / ‖θ‖ of the fragment: the default model, `diloco run --tokens 300000` (2 learners,
# H = 50, 2 fragments): first pushes 0.54 and 0.15, at most 1.07 over the run; examples/digits
# with BatchNorm (H = 20): first 0.22 and 0.12, at most 0.42 over 113 pushes. 10 leaves room for
# a larger H or learning rate; the red team's poisons were 10^3 to 10^17 times the parameters.
MAX_DELTA_TO_PARAMS = 10.0
# A fragment whose parameters are (nearly) zero: its reference is this RMS per entry instead.
MIN_PARAM_RMS = 1e-2


def delta_size_problem(norm_per_h: float, param_norm: float, numel: int) -> str:
    """Why a delta is refused for its size against its fragment's parameters ("" when it is
    not): a bound that holds from the first push, with no history to learn."""
    reference = max(param_norm, MIN_PARAM_RMS * math.sqrt(max(1, numel)))
    if norm_per_h > MAX_DELTA_TO_PARAMS * reference:
        return (
            f"delta norm {norm_per_h:.3g} per H steps is {norm_per_h / reference:.3g}× the fragment's "
            f"parameter norm {reference:.3g} (at most {MAX_DELTA_TO_PARAMS:g}×)"
        )
    return ""


def norm_outlier(
    norm_per_h: float, recent: Sequence[float], ratio: float, by: Sequence[str] = (), worker_id: str = ""
) -> str:
    """Why a delta is refused as an outlier ("" when it is not): its norm (per H steps, when it
    holds more) is more than `ratio` × the median of the fragment's recent accepted deltas'.

    `by` names who pushed each of `recent`: where other workers' norms are enough, the median is
    theirs, so a pusher cannot raise its own bar push by push (each at 9.5× the median of its own
    last ones took the norm from 2.8 to 1.5e19 in 2 minutes)."""
    reference = norm_reference(recent, by, worker_id)
    if ratio <= 0 or reference is None:
        return ""
    median, count = reference
    if median > 0 and norm_per_h > ratio * median:
        return (
            f"delta norm {norm_per_h:.3g} per H steps is {norm_per_h / median:.0f}× the median of the fragment's "
            f"last {count} ({median:.3g}; sync.max_delta_norm_ratio = {ratio:g})"
        )
    return ""


def norm_reference(
    recent: Sequence[float], by: Sequence[str] = (), worker_id: str = ""
) -> tuple[float, int] | None:
    """The median a push's norm is compared with, and how many norms it is of: other workers'
    recent ones where they are enough, else all of them; None while the history is too short."""
    if by and worker_id:
        others = [n for n, w in zip(recent, by, strict=True) if w != worker_id]
        recent = others if len(others) >= MIN_NORM_HISTORY else recent
    if len(recent) < MIN_NORM_HISTORY:
        return None
    return statistics.median(recent), len(recent)


# Running statistics (BatchNorm's running mean and variance) come as values, not deltas: a
# pushed value beyond this many times the larger of the fragment's current largest and 1 is
# absurd (honest ones follow the data's scale, which a round does not change by 10^4).
MAX_STATS_RATIO = 1e4


def running_stats_problem(name: str, pushed: torch.Tensor, current: torch.Tensor) -> str:
    """Why a pushed running statistic is refused ("" when it is fine): a variance below zero, or
    a value absurd against the fragment's current statistic."""
    if name.endswith("running_var") and bool((pushed < 0).any()):
        return f"{name}: a running variance below zero ({float(pushed.min()):.3g})"
    scale = max(1.0, float(current.abs().max())) if current.numel() else 1.0
    largest = float(pushed.abs().max()) if pushed.numel() else 0.0
    if largest > MAX_STATS_RATIO * scale:
        return f"{name}: |value| {largest:.3g} is more than {MAX_STATS_RATIO:g}× the current statistics' {scale:.3g}"
    return ""


def cut_text(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    data = text.encode()
    return text if len(data) <= limit else data[:limit].decode(errors="ignore") + " [cut]"
