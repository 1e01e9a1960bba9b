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
    ],
)
def test_a_number_out_of_range_is_refused_naming_its_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RunConfig().with_overrides({key: value}).validate()


def test_the_edges_of_each_range_are_accepted() -> None:
    edges = {"train.lr": 0.0, "train.weight_decay": 0.0, "train.warmup_steps": 0, "train.grad_clip": 0.0,
             "train.beta1": 0.0, "sync.outer_momentum": 0.0, "sync.outer_lr": 1.0}  # fmt: skip
    RunConfig().with_overrides(edges).validate()
