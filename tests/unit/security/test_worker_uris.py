"""Trust runs both ways: a worker checks the shard URIs the coordinator names against the run's
store (sent with the config at join) before it writes, reads or deletes anything there, and a data
worker given --read-root reads raw data only under it."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco import store
from diloco.compute.prefetch import ShardPrefetcher
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.data.worker import DataWorker
from diloco.v1 import coordinator_pb2 as pb


class FakeClient:
    """Only what the two checks touch: the config from the join, and the calls they make."""

    def __init__(self, store: str) -> None:
        self.config = RunConfig().with_overrides({"data.store": store})
        self.failed: list[tuple[int, str]] = []

    def fail_chunk(self, chunk_id: int, reason: str) -> None:
        self.failed.append((chunk_id, reason))


def test_a_learner_reads_only_shards_under_the_store() -> None:
    prefetcher = ShardPrefetcher(FakeClient("/runs/a"), 4, 2, threading.Event())  # type: ignore[arg-type]
    assert prefetcher._in_store("/runs/a/shards/chunk-000001-a1.shard")
    assert not prefetcher._in_store("/etc/passwd")
    assert not prefetcher._in_store("/runs/a/shards/../state/ledger.sqlite")
    assert not prefetcher._in_store("/runs/a/checkpoints/v1.safetensors")


def offline_worker(store: str, read_roots: tuple[str, ...] = ()) -> DataWorker:
    worker = DataWorker.__new__(DataWorker)  # no connection: only _process's checks run
    worker.client = FakeClient(store)  # type: ignore[assignment]
    worker.read_roots = read_roots
    return worker


MUST_NOT_RUN = SimpleNamespace(make=lambda *a: (_ for _ in ()).throw(AssertionError("must not be called")))


def test_a_data_worker_writes_no_shard_outside_the_store(tmp_path) -> None:
    worker = offline_worker(str(tmp_path / "store"))
    target = tmp_path / "elsewhere.shard"
    worker._process(pb.LeaseChunkReply(chunk_id=7, shard_uri=str(target)), MUST_NOT_RUN)  # type: ignore[arg-type]
    assert worker.client.failed == [(7, f"shard URI {str(target)!r} is outside the run's shard store")]
    assert not target.exists()


def test_a_symlink_inside_the_store_does_not_lead_out_of_it(tmp_path) -> None:
    shards = tmp_path / "store" / "shards"
    shards.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (shards / "link").symlink_to(tmp_path / "outside")
    assert store.uri_under(str(shards / "chunk-1.shard"), str(shards))
    assert not store.uri_under(str(shards / "link" / "chunk-1.shard"), str(shards))
    worker = offline_worker(str(tmp_path / "store"))
    lease = pb.LeaseChunkReply(chunk_id=3, shard_uri=str(shards / "link" / "x.shard"))
    worker._process(lease, MUST_NOT_RUN)  # type: ignore[arg-type]
    assert [chunk for chunk, _ in worker.client.failed] == [3]


def test_a_data_worker_reads_only_under_its_read_roots(tmp_path) -> None:
    data, corpus = tmp_path / "data", tmp_path / "one.txt"
    roots = (str(data), str(corpus))
    assert store.uri_within(str(data / "a" / "b.txt"), roots)
    assert store.uri_within(str(corpus), roots)  # a root may be one file
    assert not store.uri_within("/etc/shadow", roots)
    assert not store.uri_within(str(data / ".." / "secret"), roots)
    assert not store.uri_within("s3://bucket" + str(data / "x"), roots)  # another scheme
    worker = offline_worker(str(tmp_path / "store"), roots)
    shard = str(tmp_path / "store" / "shards" / "chunk-000002-a1.shard")
    lease = pb.LeaseChunkReply(chunk_id=2, shard_uri=shard, segments=[pb.Segment(uri="/etc/shadow", end=10)])
    worker._process(lease, MUST_NOT_RUN)  # type: ignore[arg-type]
    assert worker.client.failed == [
        (2, "segment '/etc/shadow' is outside this worker's read roots (--read-root)")
    ]


@pytest.mark.timeout(120)
def test_a_real_data_worker_makes_nothing_outside_its_read_roots(tiny_corpus: Path, tmp_path: Path) -> None:
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 131072})
    running = start_coordinator(cfg, str(tmp_path / "run"))
    address = f"127.0.0.1:{running.port}"
    try:
        # Told to read the corpus, which lies outside its root: every chunk is refused, nothing made.
        assert DataWorker(address, worker_id="fenced", read_roots=(str(tmp_path / "elsewhere"),)).run() == 0
        summary = running.ledger.summary()
        assert summary["shards_total"] == 0 and summary["chunks_quarantined"] == summary["chunks_total"] > 0
    finally:
        running.stop()
    running = start_coordinator(cfg, str(tmp_path / "run2"))
    try:
        # Its root holds the corpus: the same worker makes every shard.
        assert DataWorker(f"127.0.0.1:{running.port}", read_roots=(str(tiny_corpus),)).run() == 0
        summary = running.ledger.summary()
        assert summary["chunks_done"] == summary["chunks_total"] == summary["shards_total"] > 0
    finally:
        running.stop()
