"""An optimizer setting or budget out of range is refused when the config is checked, naming its
key, before `diloco run` starts a process (AdamW would refuse lr = -1 only in every learner's log)."""

from __future__ import annotations

import pytest

from diloco.config import ConfigError, RunConfig


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train.lr", -1.0),
        ("train.lr", float("nan")),
        ("train.weight_decay", -0.1),
        ("train.warmup_steps", -1),
        ("train.grad_clip", -1.0),
        ("train.max_tokens", -5),
        ("train.threads", -1),
        ("train.step_delay_s", -0.5),
        ("train.beta1", 1.0),
        ("train.beta2", -0.1),
        ("train.batch_size", 0),
        ("sync.outer_lr", -0.7),
        ("sync.outer_momentum", 1.0),
        # The coordinator's sizes, times and caps (each once passed and broke the run its own way).
        ("sync.pull_chain", 0),
        ("sync.pull_wait_s", 0.0),
        ("sync.codec_level", 23),
        ("sync.max_delta_norm_ratio", 0.5),
        ("sync.suspect_norm_ratio", 0.5),
        ("sync.suspect_alignment_gap", -0.1),
        ("sync.center_clip", 0.5),
        ("sync.suspect_loss_excess", -0.5),
        ("sync.suspect_loss_excess", float("nan")),
        ("sync.center_clip", float("nan")),
        ("sync.suspect_alignment_gap", float("nan")),
        ("sync.max_unreachable_s", float("nan")),
        ("sync.grace_factor", float("nan")),
        ("coordinator.max_inflight_pushes", 0),
        ("coordinator.lease_ttl_s", -1.0),
        ("coordinator.heartbeat_s", 0.0),
        ("coordinator.heartbeat_s", 30.0),  # not below the lease's 30 s: workers counted dead
        ("coordinator.grpc_workers", 0),
        ("coordinator.max_chunk_attempts", 0),
        ("coordinator.max_workers_per_role", 0),
        ("coordinator.max_push_bytes", 0),
        ("coordinator.push_idle_s", 0.0),
        ("data.chunk_bytes", 0),
        ("data.prefetch_batches", 0),
        ("model.vocab_size", -1),
        ("train.local_state_every_s", float("nan")),
        ("eval.every_s", float("nan")),
        ("train.lr", float("inf")),
        ("coordinator.max_message_bytes", 99_999_999_999),  # once an OverflowError in gRPC
    ],
)
def test_a_number_out_of_range_is_refused_naming_its_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RunConfig().with_overrides({key: value}).validate()


def test_the_edges_of_each_range_are_accepted() -> None:
    edges = {"train.lr": 0.0, "train.weight_decay": 0.0, "train.warmup_steps": 0, "train.grad_clip": 0.0,
             "train.beta1": 0.0, "sync.outer_momentum": 0.0, "sync.outer_lr": 1.0, "sync.pull_chain": 1,
             "sync.max_delta_norm_ratio": 0.0, "sync.max_unreachable_s": 0.0, "sync.codec_level": 0,
             "sync.suspect_norm_ratio": 0.0, "sync.suspect_alignment_gap": 0.0, "sync.center_clip": 1.0,
             "sync.suspect_loss_excess": 0.0,
             "coordinator.max_workers_per_caller": 0, "coordinator.max_concurrent_rpcs": 0,
             "coordinator.heartbeat_s": 29.0}  # fmt: skip
    RunConfig().with_overrides(edges).validate()


def test_every_watch_rule_off_leaves_nothing_to_refuse() -> None:
    # sync.refuse_suspects is on by default: turning every rule off turns the watch off with it,
    # without a second key to set.
    off = {"sync.suspect_norm_ratio": 0.0, "sync.suspect_alignment_gap": 0.0, "sync.suspect_loss_excess": 0.0}
    cfg = RunConfig().with_overrides(off)
    cfg.validate()
    assert cfg.sync.refuse_suspects
