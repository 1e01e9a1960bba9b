"""A restarted run keeps what it trains as recorded at its first start, but takes the operational
settings (coordinator.*) given at the restart: a run started with too few handler threads or too
short a lease is mended by restarting it with another value, not only by starting over."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.coordinator.run_record import open_ledger
from diloco.coordinator.workdir import resumed_config, settings_not_used


def test_a_restart_takes_operational_settings_set_now_and_keeps_the_rest() -> None:
    stored = RunConfig().with_overrides({"coordinator.lease_ttl_s": 15.0, "train.lr": 0.01})
    given = RunConfig().with_overrides({"coordinator.grpc_workers": 128, "train.lr": 0.5})
    merged, taken = resumed_config(given, stored)
    assert merged.coordinator.grpc_workers == 128 and taken == ["coordinator.grpc_workers = 128 (was 64)"]
    # What the run trains stays; an operational setting left at its default now keeps the record's.
    assert merged.train.lr == 0.01 and merged.coordinator.lease_ttl_s == 15.0
    assert settings_not_used(given, merged) == ["train.lr = 0.5 (the run's: 0.01)"]


def test_each_process_takes_its_own_threads_and_device_so_they_are_not_reported_unused() -> None:
    given = RunConfig().with_overrides({"train.threads": 2, "train.device": "cpu"})
    assert settings_not_used(given, RunConfig()) == []


def test_open_ledger_records_what_a_restart_took(tiny_corpus: Path, tmp_path: Path) -> None:
    first = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    ledger, _ = open_ledger(first, str(tmp_path))
    ledger.close()
    ledger, again = open_ledger(
        first.with_overrides({"coordinator.max_workers_per_role": 5000}), str(tmp_path)
    )
    ledger.close()
    assert again.coordinator.max_workers_per_role == 5000
    ledger, later = open_ledger(first, str(tmp_path))  # the next restart, without the flag
    ledger.close()
    assert later.coordinator.max_workers_per_role == 5000


def test_a_restart_value_that_does_not_fit_the_record_is_refused(tiny_corpus: Path, tmp_path: Path) -> None:
    first = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "coordinator.heartbeat_s": 10.0,
    })  # fmt: skip
    ledger, _ = open_ledger(first, str(tmp_path))
    ledger.close()
    with pytest.raises(ValueError, match="heartbeat_s"):
        open_ledger(first.with_overrides({"coordinator.lease_ttl_s": 5.0}), str(tmp_path))
