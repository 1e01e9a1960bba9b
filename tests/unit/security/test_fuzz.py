"""The fuzzer (diloco.testing.fuzz) against a real coordinator: a few hundred random calls here,
ten thousand and more in benchmarks/fuzz.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from diloco.testing.fuzz import Tally, audit_ok, fuzz_overrides, make_machine
from tests.support import tiny_coordinator


@pytest.mark.timeout(300)
def test_random_calls_from_several_identities_never_crash_or_poison_the_run(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    tally = Tally()
    with tiny_coordinator(tiny_corpus, tmp_path, fuzz_overrides()) as (running, _, init):
        machine = make_machine(running, init, tally)
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=15,
                stateful_step_count=20,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            ),  # fmt: skip
        )
    assert tally.calls >= 200 and tally.refused > 0, tally
    assert audit_ok(tmp_path) == []
