"""A JSONL or parquet dataset whose records lack the text field (data.text_field) trains nothing:
said at once in one line, with the fields the records have, when the coordinator lists the
dataset, or by the data worker that reads a chunk of which every record lacks it. A dataset where
only some records lack it trains as before, those records skipped and counted."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.coordinator.workdir import dataset_files
from diloco.data import fields
from diloco.data.chunks import partition
from diloco.data.fields import MissingTextField, check_dataset_field
from diloco.data.process import process_chunk
from diloco.data.worker import DataWorker
from diloco.errors import DilocoError
from diloco.tokenizer import ByteTokenizer
from tests.support import ledger_rows, run_cli


def wrong_field(path: Path, n: int = 1000, field: str = "content") -> Path:
    """The new user's file: the text under another field than "text"."""
    path.write_text("".join(json.dumps({"id": i, field: f"record {i} " + "x" * 80}) + "\n" for i in range(n)))
    return path


def test_a_dataset_whose_every_record_lacks_the_field_is_refused_naming_the_fields(tmp_path: Path) -> None:
    path = wrong_field(tmp_path / "wrongfield.jsonl")
    with pytest.raises(MissingTextField) as refused:
        check_dataset_field([str(path)], "text")
    assert str(refused.value) == (
        f"every record of {path} lacks field 'text'; set data.text_field (found fields: id, content)"
    )
    check_dataset_field([str(path)], "content")  # the right field: nothing to say


def test_compressed_parquet_and_several_files_are_refused_too(tmp_path: Path) -> None:
    plain = wrong_field(tmp_path / "a.jsonl", 50)
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    table = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["one", "two"], "n": [1, 2]}), table)
    with pytest.raises(MissingTextField, match=r"the dataset's 3 files .*found fields: id, content, body, n"):
        check_dataset_field([str(plain), str(packed), str(table)], "text")


def test_values_that_are_not_text_are_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(json.dumps({"text": i, "body": "x"}) + "\n" for i in range(10)))
    with pytest.raises(MissingTextField, match=r"lacks a string field 'text'; set data.text_field"):
        check_dataset_field([str(path)], "text")


def test_some_records_without_the_field_are_no_refusal(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        wrong_field(tmp_path / "w.jsonl", 20).read_text() + json.dumps({"text": "at last"}) + "\n"
    )
    check_dataset_field([str(mixed)], "text")
    chunks = partition([str(mixed)], 1 << 20, 0.0)
    out = process_chunk(chunks[0], ByteTokenizer(), 4, "text")
    assert out.stats.records == 1 and out.stats.skipped_missing_field == 20


def test_a_wrong_file_beside_good_ones_is_said_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = tmp_path / "good.txt"
    good.write_text("plain text trains\n")
    wrong = wrong_field(tmp_path / "wrong.jsonl", 10)
    with caplog.at_level(logging.WARNING, logger="diloco.data"):
        check_dataset_field([str(good), str(wrong)], "text")
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"every record of {wrong} lacks field 'text'; set data.text_field (found fields: id, content); "
        "its records are skipped"
    ], said


def test_a_file_longer_than_the_peek_is_warned_of_and_its_chunks_fail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond what the coordinator reads, a later record might hold the field: it warns, and each
    data worker fails the chunks of which every record lacks it, with the same line."""
    monkeypatch.setattr(fields, "PEEK_BYTES", 4096)  # read a block at a time: the first MiB
    path = wrong_field(tmp_path / "big.jsonl", 12000)
    cfg = RunConfig().with_overrides({
        "data.dataset": str(path), "data.chunk_bytes": 65536, "coordinator.max_chunk_attempts": 1,
    })  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="diloco.data"):
        running = start_coordinator(cfg, str(tmp_path / "coord"))
    said = [r.getMessage() for r in caplog.records if "lack field 'text'" in r.getMessage()]
    assert len(said) == 1 and re.match(rf"the first \d+ records of {path} lack field 'text'; ", said[0]), said
    try:
        assert DataWorker(f"127.0.0.1:{running.port}").run() == 0
    finally:
        running.stop()
    chunks = ledger_rows(tmp_path / "coord", "SELECT state, error FROM chunks ORDER BY id")
    assert len(chunks) > 2 and all(state == "quarantined" for state, _ in chunks), chunks
    assert chunks[1][1].startswith(f"every record of {path} (bytes "), chunks[1][1]
    assert chunks[1][1].endswith("lacks field 'text'; set data.text_field (found fields: id, content)")


def test_dataset_files_refuses_before_anything_starts_unless_a_preprocess_reads_the_records(
    tmp_path: Path,
) -> None:
    path = wrong_field(tmp_path / "wrongfield.jsonl")
    cfg = RunConfig().with_overrides({"data.dataset": str(path)})
    with pytest.raises(DilocoError, match="lacks field 'text'; set data.text_field"):
        dataset_files(cfg)
    assert dataset_files(cfg.with_overrides({"data.preprocess": "tests.toy_preprocess:rows"}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "coordinator"])
def test_the_cli_says_it_in_one_line(tmp_path: Path, command: str) -> None:
    path = wrong_field(tmp_path / "wrongfield.jsonl")
    result = run_cli([command, "--dataset", str(path), "--workdir", str(tmp_path / "w")], timeout=100)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"error: every record of {path} lacks field 'text'; set data.text_field (found fields: id, content)"
    ), result.stderr
    assert "Traceback" not in result.stderr
