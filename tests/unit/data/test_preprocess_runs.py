"""A preprocess at work in a real data worker against a real coordinator (both in this process):
its shards are recorded, and one that breaks the contract or differs from the run's fails its
chunks (quarantined after the configured attempts), leaves no shard behind, and the run goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.data.shard import read_shard
from diloco.data.worker import DataWorker
from diloco.errors import DilocoError
from tests.support import ledger_rows


def csv_dataset(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "table.csv"
    path.parent.mkdir()
    path.write_text("a,b\n" + "".join(f"{i},{i * 0.5}\n" for i in range(400)))
    return path.parent


def config(tmp_path: Path, preprocess: str) -> RunConfig:
    return RunConfig().with_overrides({
        "data.dataset": str(csv_dataset(tmp_path)), "data.preprocess": preprocess, "data.chunk_bytes": 1024,
        "data.eval_fraction": 0.0, "coordinator.max_chunk_attempts": 2,
    })  # fmt: skip


def test_a_preprocess_makes_shards_of_its_columns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    running = start_coordinator(config(tmp_path, "tests.toy_preprocess:rows"), str(tmp_path / "coord"))
    caplog.set_level("INFO", logger="diloco.data")
    try:
        assert DataWorker(f"127.0.0.1:{running.port}").run() == 0
    finally:
        running.stop()
    # The worker counts what the run counts: samples, not tokens.
    assert re.search(r"rows=\d+ samples=\d+ in .* samples/s\)", caplog.text), caplog.text
    assert "tokens" not in caplog.text and "400 samples)" in caplog.text
    shards = ledger_rows(tmp_path / "coord", "SELECT uri, checksum, rows, tokens FROM shards")
    assert sum(r[2] for r in shards) == 400 and all(r[2] == r[3] for r in shards)  # one sample a row
    shard = read_shard(shards[0][0], shards[0][1])
    assert shard.unit == "samples" and shard.columns["x"].shape[1:] == (2,)
    assert json.loads(ledger_rows(tmp_path / "coord", "SELECT value FROM meta WHERE key='schema'")[0][0]) == [
        {"dtype": "<f4", "name": "x", "shape": [2]}, {"dtype": "<i8", "name": "y", "shape": []},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("preprocess", "env", "error"),
    [
        ("tests.toy_preprocess:rows", {"TOY_PREPROCESS_DTYPE": "float64"}, r"x: <f8\[2\] vs <f4\[2\]"),
        (
            "tests.toy_preprocess:not_arrays",
            {},
            "data.preprocess tests.toy_preprocess:not_arrays returned list",
        ),
    ],
)
def test_a_preprocess_that_breaks_the_contract_or_differs_fails_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preprocess: str, env: dict[str, str], error: str
) -> None:
    running = start_coordinator(config(tmp_path, preprocess), str(tmp_path / "coord"))
    # Another data worker already recorded the run's columns (float32 x).
    running.ledger.first_meta(
        "schema",
        json.dumps(
            [{"dtype": "<f4", "name": "x", "shape": [2]}, {"dtype": "<i8", "name": "y", "shape": []}],
            sort_keys=True,
        ),
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        assert DataWorker(f"127.0.0.1:{running.port}").run() == 0  # it goes on, then finds nothing left
    finally:
        running.stop()
    chunks = ledger_rows(tmp_path / "coord", "SELECT state, attempts, error FROM chunks")
    assert chunks and all(state == "quarantined" and attempts == 2 for state, attempts, _ in chunks), chunks
    assert all(re.search(error, e) for _, _, e in chunks), chunks[0][2]
    assert not ledger_rows(tmp_path / "coord", "SELECT id FROM shards")
    assert not list((tmp_path / "coord" / "shards").glob("*")), "a refused shard was left in the store"


def test_a_preprocess_that_cannot_be_imported_is_refused_at_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_ALLOW_CODE", "tests.no_such_module:f")  # allowed here, yet not installed
    running = start_coordinator(config(tmp_path, "tests.no_such_module:f"), str(tmp_path / "coord"))
    try:
        with pytest.raises(DilocoError, match=r"data.preprocess 'tests.no_such_module:f': cannot import"):
            DataWorker(f"127.0.0.1:{running.port}").run()
    finally:
        running.stop()
