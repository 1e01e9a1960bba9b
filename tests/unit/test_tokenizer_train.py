"""`diloco tokenizer train`, the tokenizer check every worker makes at join, and bad input reaching
`diloco status`."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from diloco.compute.learner import Learner
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.data.worker import DataWorker
from diloco.errors import DilocoError
from diloco.tokenizer import TokenizerMismatch, load_tokenizer
from diloco.tokenizer_train import train_tokenizer
from diloco.views import records_line
from tests.support import ledger_rows, run_cli


def mixed_dataset(source: Path, out: Path) -> Path:
    """The files of `source` (.txt) spread over every format a run reads, plus some bad input:
    a truncated .zst, an empty file, JSONL lines that are not JSON or lack the field."""
    out.mkdir()
    files = sorted(source.glob("*.txt"))
    texts = [f.read_text() for f in files]
    third = len(texts) // 3
    (out / "a.jsonl.gz").write_bytes(
        gzip.compress(
            b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:third])
            + b'not json\n{"body": "no text field"}\n'
        )
    )
    pq.write_table(pa.table({"text": texts[third : 2 * third] + [None]}), out / "b.parquet", row_group_size=4)
    for i, f in enumerate(files[2 * third :]):
        shutil.copy(f, out / f"c{i:03d}.txt")
    whole = zstandard.ZstdCompressor().compress("".join(texts[:5]).encode())
    (out / "d.txt.zst").write_bytes(whole[: len(whole) // 2])  # truncated: kept up to the damage
    (out / "e.jsonl").write_bytes(b"")
    return out


@pytest.fixture
def mixed(tiny_corpus: Path, tmp_path: Path) -> Path:
    return mixed_dataset(tiny_corpus, tmp_path / "mixed")


def test_train_tokenizer_reads_every_format_within_the_byte_budget(mixed: Path, tmp_path: Path):
    out = tmp_path / "store" / "tokenizer.json"
    result = train_tokenizer(str(mixed), 320, str(out), max_bytes=60_000)
    data = out.read_bytes()
    assert result.uri == str(out) and result.sha256 == hashlib.sha256(data).hexdigest()
    assert 57_000 <= result.sample_bytes <= 60_000  # bounded, and spread over the files
    assert result.files >= 5 and result.stats.empty_files == 1 and result.stats.truncated_compressed <= 1
    tok = load_tokenizer(str(out))
    assert tok.fingerprint == result.sha256 and tok.vocab_size == 320 == result.vocab_size
    assert tok.decode([tok.eot_id]) == "" and result.eot_id == tok.eot_id == 0
    text = "def f(x):\n    return x + 1  # é\n"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text.encode())
    with pytest.raises(DilocoError, match="at least 257"):
        train_tokenizer(str(mixed), 100, str(tmp_path / "x.json"))


def tokenizer_coordinator(dataset: Path, tokenizer: Path, workdir: Path):
    cfg = RunConfig().with_overrides({
        "data.dataset": str(dataset), "data.chunk_bytes": 65536, "data.tokenizer": str(tokenizer),
        "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32, "model.kwargs.n_head": 2, "sync.fragments": 1,
    })  # fmt: skip
    return start_coordinator(cfg, str(workdir))


@pytest.mark.timeout(120)
def test_bad_input_is_counted_and_reaches_status(mixed: Path, tmp_path: Path):
    train_tokenizer(str(mixed), 300, str(tmp_path / "tok.json"), max_bytes=50_000)
    running = tokenizer_coordinator(mixed, tmp_path / "tok.json", tmp_path / "run")
    try:
        address = f"127.0.0.1:{running.port}"
        assert DataWorker(address).run() == 0
        detail = running.service.status_detail()
        stats = detail["record_stats"]
        assert stats["empty_files"] == 1
        assert stats["truncated_compressed"] == 1
        assert stats["skipped_not_json"] == 1 and stats["skipped_missing_field"] == 2  # one JSONL, one null
        assert stats["records"] > 10 and detail["chunks_done"] == detail["chunks_total"]
        assert detail["chunks_quarantined"] == 0
        line = records_line(stats)
        assert "empty_files 1" in line and "truncated_compressed 1" in line and "not_json 1" in line
        shown = run_cli(["status", "--coordinator", address], timeout=30)
        assert shown.returncode == 0 and line.removeprefix("records ") in shown.stdout, (
            shown.stdout + shown.stderr
        )
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_workers_refuse_a_tokenizer_that_changed(mixed: Path, tmp_path: Path):
    tok = tmp_path / "tok.json"
    train_tokenizer(str(mixed), 300, str(tok), max_bytes=30_000)
    running = tokenizer_coordinator(mixed, tok, tmp_path / "run")
    address = f"127.0.0.1:{running.port}"
    try:
        assert running.service.tokenizer_hash == hashlib.sha256(tok.read_bytes()).hexdigest()
        # The file changes after the coordinator started: same vocabulary size, other merges.
        train_tokenizer(str(mixed), 300, str(tok), max_bytes=10_000)
        with pytest.raises(TokenizerMismatch, match="coordinator started the run"):
            DataWorker(address).run()
        with pytest.raises(TokenizerMismatch):
            Learner(address)._setup()
        result = run_cli(["data", "--coordinator", address], timeout=60)
        assert result.returncode == 2, result.stderr
        assert "error: tokenizer" in result.stderr and "Traceback" not in result.stderr
        assert running.service.status_detail()["chunks_done"] == 0  # nobody worked with it
    finally:
        running.stop()
    # Nor does the coordinator resume the run on the changed file.
    with pytest.raises(DilocoError, match="changed since this run started"):
        tokenizer_coordinator(mixed, tok, tmp_path / "run")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_trained_tokenizer_runs_a_job(mixed: Path, tmp_path: Path):
    store_dir = tmp_path / "store"
    trained = run_cli(
        ["tokenizer", "train", "--dataset", str(mixed), "--vocab", "400", "--store", str(store_dir)],
        timeout=60,
    )
    assert trained.returncode == 0, trained.stderr
    uri = str(store_dir / "tokenizer" / "tokenizer.json")
    assert f"tokenizer {uri}" in trained.stdout
    assert f"sha256 {hashlib.sha256(Path(uri).read_bytes()).hexdigest()}" in trained.stdout

    workdir = tmp_path / "run"
    result = run_cli(
        [
            "run", "--dataset", str(mixed), "--workdir", str(workdir), "--minutes", "0", "--tokens", "64000",
            "--learners", "1", "--data-workers", "1", "--inner-steps", "4", "--no-progress",
            "--set", f"data.tokenizer={uri}", "--set", "data.chunk_bytes=65536", "--set", "train.batch_size=8",
            "--set", "train.warmup_steps=1", "--set", "train.lr=0.003", "--set", "model.kwargs.n_layer=1",
            "--set", "model.kwargs.n_embd=32", "--set", "model.kwargs.n_head=2", "--set", "sync.overlap_steps=1",
        ],
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    # The run's coordinator took the trained tokenizer: its hash, and its vocabulary for the model.
    meta = dict(ledger_rows(workdir, "SELECT key, value FROM meta"))
    assert meta["tokenizer_hash"] == hashlib.sha256(Path(uri).read_bytes()).hexdigest()
    assert json.loads(meta["config"])["model"]["vocab_size"] == 400
    assert summary["tokens_merged"] >= 64000 and summary["rounds"] >= 2
    assert (
        summary["record_stats"]["truncated_compressed"] == 1 and summary["record_stats"]["empty_files"] == 1
    )
    assert summary["eval_loss"] < summary["first_loss"]
