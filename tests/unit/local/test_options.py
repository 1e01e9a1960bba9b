"""A local job's options are checked where they are built (the CLI only parses): each refusal one
line naming the flag."""

from __future__ import annotations

import pytest

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
