"""Whether a run's configuration can be used: every value checked, each refusal saying which key
and why (a ConfigError), before any role acts on it."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from diloco.config_parse import ConfigError

if TYPE_CHECKING:
    from diloco.config import RunConfig

# The devices a learner can be told to use (whether this machine has them is the learner's check);
# "" is "auto", as it always was.
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)?")
PRECISIONS = ("auto", "bf16", "fp32")
# The codecs sync.codec and sync.pull_codec may name, most precise first (diloco.wire.codecs gives
# each its id on the wire; this module stays free of torch).
CODECS = ("fp32", "bf16", "int8", "int4")
MERGES = ("mean", "token", "rda")
SHORT_PUSH_SCALES = ("balanced", "none")
GRPC_INT_MAX = 2**31 - 1


def is_device_spec(spec: str) -> bool:
    return _DEVICE.fullmatch(spec.strip().lower()) is not None


def check_numbers(cfg: RunConfig) -> None:
    """The optimizers' settings and the budgets: a value out of range would otherwise surface only
    in every learner's log, as a traceback from torch (AdamW refuses lr = -1), after the set-up."""
    t, s = cfg.train, cfg.sync
    non_negative = {
        "train.lr": t.lr,
        "train.weight_decay": t.weight_decay,
        "train.warmup_steps": t.warmup_steps,
        "train.grad_clip": t.grad_clip,
        "train.max_tokens": t.max_tokens,
        "train.threads": t.threads,
        "train.step_delay_s": t.step_delay_s,
        "sync.outer_lr": s.outer_lr,
    }
    for key, value in non_negative.items():
        if not 0 <= value < math.inf:  # (not <: NaN is refused too; and an infinite step)
            raise ConfigError(f"{key} must be >= 0 and finite, got {value}")
    check_limits(cfg)
    for key, value in {
        "train.beta1": t.beta1,
        "train.beta2": t.beta2,
        "sync.outer_momentum": s.outer_momentum,
    }.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")


def check_limits(cfg: RunConfig) -> None:
    """The coordinator's and the data path's sizes, times and caps: a zero or a negative there
    passed the check and then broke the run in its own way (no push slot ever free, a chain of
    kept deltas that never shrinks, workers counted dead between their own heartbeats)."""
    c, s, d = cfg.coordinator, cfg.sync, cfg.data
    at_least: dict[str, tuple[float, float, str]] = {  # key: (value, least, what a zero would mean)
        "model.vocab_size": (cfg.model.vocab_size, 0, " (0: the tokenizer's)"),
        "data.chunk_bytes": (d.chunk_bytes, 1, ""),
        "data.prefetch_batches": (d.prefetch_batches, 1, ""),
        "sync.pull_chain": (s.pull_chain, 1, ""),
        "sync.max_unreachable_s": (s.max_unreachable_s, 0, " (0: never stop stepping)"),
        "sync.max_delta_norm_ratio": (s.max_delta_norm_ratio, 0, " (0: no outlier check)"),
        "sync.suspect_norm_ratio": (s.suspect_norm_ratio, 0, " (0: no learner named by its norm)"),
        "sync.suspect_alignment_gap": (s.suspect_alignment_gap, 0, " (0: none by its direction)"),
        "sync.suspect_loss_excess": (s.suspect_loss_excess, 0, " (0: none by its loss)"),
        "sync.suspect_disagreement": (s.suspect_disagreement, 0, " (0: none against the others)"),
        "sync.center_clip": (s.center_clip, 0, " (0: no clipping)"),
        "coordinator.stream_chunk_bytes": (c.stream_chunk_bytes, 1, ""),
        "coordinator.max_push_bytes": (c.max_push_bytes, 1, ""),
        "coordinator.grpc_workers": (c.grpc_workers, 1, ""),
        "coordinator.max_chunk_attempts": (c.max_chunk_attempts, 1, ""),
        "coordinator.max_inflight_pushes": (c.max_inflight_pushes, 1, ""),
        "coordinator.push_base_s": (c.push_base_s, 0, ""),
        "coordinator.max_workers_per_role": (c.max_workers_per_role, 1, ""),
        "coordinator.max_workers_per_caller": (c.max_workers_per_caller, 0, " (0: no cap)"),
        "coordinator.forget_workers_after_s": (c.forget_workers_after_s, 0, " (0: kept for good)"),
        "coordinator.max_leases_per_worker": (c.max_leases_per_worker, 0, " (0: no cap)"),
        "coordinator.max_pushes_per_caller": (c.max_pushes_per_caller, 0, " (0: no cap)"),
        "coordinator.max_waiting_pulls_per_caller": (c.max_waiting_pulls_per_caller, 0, " (0: no cap)"),
        "coordinator.max_waiting_pulls": (c.max_waiting_pulls, 0, " (0: no cap)"),
        "coordinator.max_concurrent_rpcs": (c.max_concurrent_rpcs, 0, " (0: no cap)"),
        "coordinator.min_publish_interval_s": (c.min_publish_interval_s, 0, ""),
        "train.local_state_every_s": (cfg.train.local_state_every_s, 0, " (0: no local state)"),
        "sync.grace_factor": (s.grace_factor, 0, " (0: close at quorum)"),
        "eval.every_s": (cfg.eval.every_s, 0, ""),
        "eval.sample_tokens": (cfg.eval.sample_tokens, 0, " (0: no sample)"),
        "eval.recalibrate_batches": (cfg.eval.recalibrate_batches, 0, " (0: the merged statistics)"),
    }
    for key, (value, least, zero) in at_least.items():
        if not value >= least:  # NaN too
            raise ConfigError(f"{key} must be >= {least}{zero}, got {value}")
    positive = {
        "sync.pull_wait_s": s.pull_wait_s,
        "coordinator.lease_ttl_s": c.lease_ttl_s,
        "coordinator.heartbeat_s": c.heartbeat_s,
        "coordinator.push_idle_s": c.push_idle_s,
        "coordinator.push_min_bytes_per_s": c.push_min_bytes_per_s,
    }
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if c.heartbeat_s >= c.lease_ttl_s:
        raise ConfigError(
            f"coordinator.heartbeat_s ({c.heartbeat_s:g}) must be below coordinator.lease_ttl_s "
            f"({c.lease_ttl_s:g}): a worker is counted dead when no heartbeat came for a lease's time"
        )
    # Ratios to the others' median: 0 turns the rule off, and below 1 an ordinary value crosses it.
    below_one = {
        "sync.max_delta_norm_ratio": (s.max_delta_norm_ratio, "no check", "refuses a delta for being as large as the median of the recent ones"),
        "sync.suspect_norm_ratio": (s.suspect_norm_ratio, "off", "names a learner for pushing as much as the others"),
        "sync.center_clip": (s.center_clip, "off", "clips a delta for deviating as much as the others"),
    }  # fmt: skip
    for key, (value, zero, below) in below_one.items():
        if 0 < value < 1:
            raise ConfigError(f"{key} must be 0 ({zero}) or >= 1, got {value:g}: below 1 it {below}")
    if c.max_message_bytes > GRPC_INT_MAX:  # gRPC's channel arguments are C ints
        raise ConfigError(
            f"coordinator.max_message_bytes must be at most {GRPC_INT_MAX}, got {c.max_message_bytes}"
        )
    if not 0 <= s.codec_level <= 22:
        raise ConfigError(
            f"sync.codec_level must be a zstd level, 1 to 22 (0: zstd's default), got {s.codec_level}"
        )


def check(cfg: RunConfig) -> None:
    m, t, s = cfg.model, cfg.train, cfg.sync
    named = {"model.factory": m.factory}
    if cfg.data.preprocess:
        named["data.preprocess"] = cfg.data.preprocess
    for key, spec in named.items():
        if spec.count(":") != 1 or not all(part.strip() for part in spec.split(":")):
            raise ConfigError(f'{key} must be "package.module:function", not {spec!r}')
    if not 0 < t.local_state_max_share <= 1:
        raise ConfigError(f"train.local_state_max_share must be in (0, 1], got {t.local_state_max_share}")
    if t.inner_steps < 1 or t.batch_size < 1 or m.seq_len < 2:
        raise ConfigError("train.inner_steps, train.batch_size must be >= 1 and model.seq_len >= 2")
    check_numbers(cfg)
    if t.precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {t.precision!r}")
    if s.fragments < 1 or s.quorum < 0:
        raise ConfigError("sync.fragments must be >= 1 and sync.quorum >= 0")
    if (
        min(s.overlap_steps, s.max_staleness, s.grace_steps, s.outer_warmup_rounds) < 0
        or not 0.0 <= s.mix_alpha < 1.0
    ):
        raise ConfigError(
            "sync.overlap_steps, sync.max_staleness, sync.grace_steps and "
            "sync.outer_warmup_rounds must be >= 0, and sync.mix_alpha in [0, 1)"
        )
    if s.short_push_scale not in SHORT_PUSH_SCALES:
        raise ConfigError(
            f"sync.short_push_scale must be one of {', '.join(SHORT_PUSH_SCALES)}, not {s.short_push_scale!r}"
        )
    if not 0.0 < s.stale_decay <= 1.0:
        raise ConfigError(f"sync.stale_decay must be in (0, 1], got {s.stale_decay}")
    if t.inner_steps % s.fragments:
        raise ConfigError(
            f"train.inner_steps (H = {t.inner_steps}) must be a multiple of sync.fragments (P = {s.fragments}): "
            "each fragment is pushed every H steps, one every H/P"
        )
    if s.overlap_steps >= t.inner_steps:
        raise ConfigError(
            f"sync.overlap_steps (τ = {s.overlap_steps}) must be below train.inner_steps (H = {t.inner_steps}): "
            "a fragment's merge must be applied before its next push"
        )
    for key in ("codec", "pull_codec"):
        if getattr(s, key) not in CODECS:
            raise ConfigError(f"sync.{key} must be one of {', '.join(CODECS)}, not {getattr(s, key)!r}")
    if not is_device_spec(t.device):
        raise ConfigError(f"train.device must be {DEVICE_FORMS}, not {t.device!r}")
    if s.merge not in MERGES:
        raise ConfigError(f"sync.merge must be one of {', '.join(MERGES)}, not {s.merge!r}")
    if cfg.data.max_record_bytes < 1:
        raise ConfigError("data.max_record_bytes must be >= 1")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError("data.eval_fraction must be in [0, 1)")
    if cfg.data.epochs < 1:
        raise ConfigError("data.epochs must be >= 1")
    if cfg.data.mix_shards < 1:
        raise ConfigError("data.mix_shards must be >= 1")
    if cfg.data.deal < 0:
        raise ConfigError("data.deal must be >= 0 (0: first come, first served)")
    if cfg.data.max_ready_shards < 0:
        raise ConfigError("data.max_ready_shards must be >= 0 (0: no limit)")
    if cfg.data.cache_bytes < 0:
        raise ConfigError("data.cache_bytes must be >= 0 (0: no shard cache)")
    if cfg.coordinator.stream_chunk_bytes * 2 > cfg.coordinator.max_message_bytes:
        raise ConfigError("coordinator.stream_chunk_bytes must be under half of max_message_bytes")
    if cfg.eval.every_merges < 0:  # (eval.every_s: check_limits)
        raise ConfigError("eval.every_merges must be >= 0 (0 with eval.every_s 0: no evaluator)")
    if min(cfg.eval.max_batches, cfg.eval.final_batches, cfg.eval.threads) < 1:
        raise ConfigError("eval.max_batches, eval.final_batches and eval.threads must be >= 1")
    if cfg.coordinator.keep_versions == 1 or cfg.coordinator.keep_versions < 0:
        raise ConfigError("coordinator.keep_versions must be 0 (every version) or at least 2")
