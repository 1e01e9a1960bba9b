"""A local job's options are checked where they are built (the CLI only parses): each refusal one
line naming the flag."""

from __future__ import annotations

import os

import pytest

from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.local.options import LocalRunOptions


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"chaos_interval": -5.0}, "--chaos-interval must be >= 0"),  # once: a kill every 0.5 s
        ({"chaos_interval": float("nan")}, "--chaos-interval must be >= 0"),
        ({"chaos_roles": ("learner", "gpu")}, "--chaos-roles: unknown role.s. gpu"),
        ({"learners": 0}, "--learners"),
        ({"learner_ranks": (2, 0)}, "--learner-ranks"),
        ({"data_workers": 0}, "--data-workers"),
        ({"data_parallel": "zero3"}, "--data-parallel must be ddp or fsdp"),
        ({"slow_learner": 0.5}, "--slow-learner must be >= 1"),
        ({"minutes": -1.0}, "--minutes"),
    ],
)
def test_options_out_of_range_are_refused_naming_the_flag(options: dict, said: str) -> None:
    with pytest.raises(DilocoError, match=said):
        LocalRunOptions(**options)


def test_the_defaults_and_edges_are_taken() -> None:
    LocalRunOptions()
    LocalRunOptions(
        chaos_interval=0.0, chaos_roles=("coordinator", "evaluator"), minutes=0.0, slow_learner=1.0
    )


def test_the_job_config_fills_in_what_the_config_left_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads split over every rank of every learner, one deal slot per learner, a few ready shards
    per learner ahead (none bounded when every chunk is made first), the token budget and the name."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    cfg = LocalRunOptions(learners=2, learner_ranks=(2, 1), tokens=5000).job_config("job")
    assert (cfg.train.threads, cfg.data.deal, cfg.data.max_ready_shards) == (2, 2, 4)
    assert (cfg.train.max_tokens, cfg.name) == (5000, "job")
    assert LocalRunOptions(prepare_first=True).job_config("job").data.max_ready_shards == 0
    set_by_user = RunConfig().with_overrides({"train.threads": 3, "data.deal": 5, "data.max_ready_shards": 7})
    cfg = LocalRunOptions(config=set_by_user).job_config("job")
    assert (cfg.train.threads, cfg.data.deal, cfg.data.max_ready_shards) == (3, 5, 7)
