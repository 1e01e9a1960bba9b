"""S3 for real: diloco's store, shards and whole runs against a SeaweedFS server on loopback.

The `s3_server` fixture (tests/conftest.py) starts one `weed server` per session; child processes
get its AWS_* variables, in-process code gets them through monkeypatch.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import s3fs

from diloco import store
from diloco.data.shard import ShardCorrupt, read_shard, write_shard
from diloco.local.procs import ProcessGroup
from diloco.testing.seaweed import SeaweedS3
from tests.support import QUICK_END, ledger_rows, run_cli, start_coordinator, wait_for


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """The server, with this process's AWS environment pointed at it for the test."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


def new_bucket(s3: SeaweedS3) -> str:
    return s3.create_bucket(f"t-{uuid.uuid4().hex[:12]}")


def upload_dir(s3: SeaweedS3, local: Path, uri: str) -> int:
    """Every file of a local directory under an s3:// prefix (with a plain S3 client); bytes sent."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    sent = 0
    for path in sorted(local.iterdir()):
        data = path.read_bytes()
        s3.client().put_object(Bucket=bucket, Key=f"{prefix.strip('/')}/{path.name}", Body=data)
        sent += len(data)
    return sent


def etag(s3: SeaweedS3, uri: str) -> str:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return s3.client().head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def test_store_round_trip_on_s3(s3_env: SeaweedS3) -> None:
    root = new_bucket(s3_env) + "/run"
    a, b = store.join(root, "a.bin"), store.join(root, "sub", "b.txt")
    store.write_bytes_atomic(a, b"0123456789")
    store.write_bytes_atomic(b, b"hello")
    assert store.read_bytes(a) == b"0123456789"
    assert store.read_bytes(a, 2, 5) == b"234"
    assert store.read_bytes(a, 7, 100) == b"789"
    assert store.size(a) == 10 and store.size(b) == 5
    assert store.exists(a) and not store.exists(store.join(root, "nope"))
    assert store.list_files(root) == [a, b]
    assert store.list_files(store.join(root, "*.bin")) == [a]
    assert store.list_files(b) == [b]

    # Objects written by someone else are seen at once (no stale listing or existence cache).
    bucket, _, _ = root.removeprefix("s3://").partition("/")
    s3_env.client().put_object(Bucket=bucket, Key="run/c.txt", Body=b"from another process")
    c = store.join(root, "c.txt")
    assert store.list_files(root) == [a, c, b]
    assert store.exists(c) and store.size(c) == 20

    store.write_bytes_atomic(a, b"new")  # overwrite
    assert store.read_bytes(a) == b"new"
    store.remove(a)
    store.remove(a)  # removing what is gone is not an error
    assert not store.exists(a)
    assert store.list_files(root) == [c, b]
    with pytest.raises(store.StoreError, match="not found"):
        store.read_bytes(a)
    with pytest.raises(store.StoreError, match="not found"):
        store.list_files(store.join(root, "missing/"))


def test_store_follows_the_environment(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed AWS environment is used at once, not hidden by a cached filesystem."""
    uri = store.join(new_bucket(s3_env), "k.txt")
    store.write_bytes_atomic(uri, b"v")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionError):
        store.read_bytes(uri)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    assert store.read_bytes(uri) == b"v"


def test_big_shard_goes_up_multipart_and_reads_back_verified(s3_env: SeaweedS3) -> None:
    root = new_bucket(s3_env) + "/shards"
    rng = np.random.default_rng(0)
    # Random ids do not compress: about 2.5 blocks of stored bytes.
    rows = rng.integers(0, 65536, size=(5 * store.S3_BLOCK_SIZE // (2 * 1025), 1025), dtype=np.int64)
    big = write_shard(store.join(root, "big.shard"), rows, tokenizer_id="t", vocab_size=65536, chunk_index=0)
    assert big.nbytes > 2 * store.S3_BLOCK_SIZE
    assert store.size(big.uri) == big.nbytes
    parts = etag(s3_env, big.uri).rpartition("-")[2]
    assert parts.isdigit() and int(parts) == -(-big.nbytes // store.S3_BLOCK_SIZE), etag(s3_env, big.uri)
    back = read_shard(big.uri, big.checksum)
    assert np.array_equal(back.rows, rows) and back.header["checksum"] == big.checksum

    small = write_shard(
        store.join(root, "small.shard"), rows[:10], tokenizer_id="t", vocab_size=65536, chunk_index=1
    )
    assert "-" not in etag(s3_env, small.uri), "a small shard should be a single PUT"
    assert np.array_equal(read_shard(small.uri, small.checksum).rows, rows[:10])
    with pytest.raises(ShardCorrupt):
        read_shard(small.uri, big.checksum)


def test_failed_multipart_upload_publishes_nothing(
    s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part that fails aborts the upload: no object under the final name, no upload left open."""
    bucket = new_bucket(s3_env)
    name = bucket.removeprefix("s3://")
    uri = store.join(bucket, "half.bin")
    real = s3fs.core.S3File._call_s3
    open_uploads: list = []

    def flaky(self, method, *args, **kwargs):
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            open_uploads.extend(s3_env.client().list_multipart_uploads(Bucket=name).get("Uploads", []))
            raise OSError("injected: the network went away")
        return real(self, method, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(s3fs.core.S3File, "_call_s3", flaky)
        with pytest.raises(OSError, match="injected"):
            store.write_bytes_atomic(uri, bytes(3 * store.S3_BLOCK_SIZE))
    assert len(open_uploads) == 1, "the write should have been a multipart upload in progress"
    assert not store.exists(uri)
    assert not s3_env.client().list_multipart_uploads(Bucket=name).get("Uploads")


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_whole_run_with_dataset_shards_and_checkpoints_on_s3(
    s3_server: SeaweedS3, tiny_corpus: Path, tmp_path: Path
) -> None:
    bucket = new_bucket(s3_server)
    dataset, run_store = f"{bucket}/corpus/", f"{bucket}/run1"
    upload_dir(s3_server, tiny_corpus, dataset)
    workdir = tmp_path / "run"
    result = run_cli(
        [
            "run",
            "--dataset",
            dataset,
            "--store",
            run_store,
            "--workdir",
            str(workdir),
            "--tokens",
            "80000",
            "--minutes",
            "1.5",
            "--learners",
            "1",
            "--data-workers",
            "1",
            "--inner-steps",
            "10",
            "--seed",
            "3",
            "--no-progress",
            "--set",
            "data.chunk_bytes=32768",
            # Every chunk becomes a shard (asserted below), not only the few ahead of the learner
            # that `diloco run` makes by default.
            "--set",
            "data.max_ready_shards=1000000",
            "--set",
            "sync.overlap_steps=3",
            # A small model: the point is the storage path, and eval + sampling stay quick.
            "--set",
            "model.kwargs.n_layer=2",
            *QUICK_END,
            "--set",
            "model.kwargs.n_embd=64",
            "--set",
            "train.lr=0.003",
            "--set",
            "train.warmup_steps=5",
        ],
        timeout=200,
        env=s3_server.env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rounds"] >= 2 and summary["tokens_merged"] > 0, summary
    assert summary["eval_loss"] is not None and summary["eval_loss"] < summary["first_loss"] - 0.5, summary

    # Shards and checkpoints are in the bucket, and nothing of them on local disk.
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env.items():
            mp.setenv(key, value)
        shards = store.list_files(f"{run_store}/shards")
        checkpoints = store.list_files(f"{run_store}/checkpoints")
    recorded = [uri for (uri,) in ledger_rows(workdir, "SELECT uri FROM shards")]
    assert recorded and all(uri.startswith(f"{run_store}/shards/") for uri in recorded)
    assert sorted(recorded) == [s for s in shards if s.endswith(".shard")]
    assert len(shards) == summary["shards"] == summary["chunks"]
    assert any(c.endswith(".safetensors") for c in checkpoints), checkpoints
    assert not (workdir / "shards").exists() and not (workdir / "checkpoints").exists()
    # The run's own audit looked for every shard and checkpoint in the bucket.
    assert summary["audit_ok"], summary["audit_violations"]


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_raw_data_on_s3_with_local_state_and_store(
    s3_server: SeaweedS3, tiny_corpus: Path, tmp_path: Path
) -> None:
    """The roles by hand: JSONL records in a bucket; ledger, shards and checkpoints on local disk."""
    bucket = new_bucket(s3_server)
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    files = sorted(tiny_corpus.iterdir())
    for i in range(0, len(files), 4):
        lines = [json.dumps({"text": f.read_text(errors="replace")}) for f in files[i : i + 4]]
        (jsonl / f"part-{i // 4:03d}.jsonl").write_text("\n".join(lines) + "\n")
    upload_dir(s3_server, jsonl, f"{bucket}/raw")

    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", env=s3_server.env, fork=True)
    try:
        address = start_coordinator(
            group,
            workdir,
            [
                "--dataset",
                f"{bucket}/raw/*.jsonl",
                "--set",
                "data.chunk_bytes=65536",
                "--set",
                "train.inner_steps=10",
                "--set",
                "sync.overlap_steps=3",
                "--set",
                "train.threads=1",
                "--set",
                "train.max_tokens=60000",
            ],
        )
        data = group.spawn("data-0", "data", ["data", "--coordinator", address])
        learner = group.spawn("learner-0", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        assert group.wait([data], timeout_s=90), "data worker did not finish: " + group.tail(data)
        assert data.proc.returncode == 0, group.tail(data)
        chunks = ledger_rows(workdir, "SELECT COUNT(*), SUM(state = 'done') FROM chunks")[0]
        assert chunks[0] > 1 and chunks[0] == chunks[1], chunks
        shards = sorted((workdir / "shards").glob("*.shard"))
        assert len(shards) == chunks[0]
        for uri, checksum in ledger_rows(workdir, "SELECT uri, checksum FROM shards"):
            assert not uri.startswith("s3://") and Path(uri).parent == workdir / "shards"
            assert read_shard(uri, checksum).rows.size > 0
        wait_for(
            lambda: ledger_rows(workdir, "SELECT COUNT(*) FROM pushes WHERE state = 'merged'")[0][0] > 0,
            90,
            "a merged push",
        )
        assert list((workdir / "checkpoints").glob("*.safetensors"))
        assert learner.alive or learner.proc.returncode == 0, group.tail(learner)
    finally:
        group.stop()
