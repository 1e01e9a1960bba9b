"""Trust runs both ways: a worker checks the shard URIs the coordinator names against the run's
store (sent with the config at join) before it writes, reads or deletes anything there."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from diloco.compute.prefetch import ShardPrefetcher
from diloco.config import RunConfig
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


def test_a_data_worker_writes_no_shard_outside_the_store(tmp_path) -> None:
    worker = DataWorker.__new__(DataWorker)  # no connection: only _process's check runs
    worker.client = FakeClient(str(tmp_path / "store"))  # type: ignore[assignment]
    target = tmp_path / "elsewhere.shard"
    lease = pb.LeaseChunkReply(chunk_id=7, shard_uri=str(target))
    maker = SimpleNamespace(make=lambda *a: (_ for _ in ()).throw(AssertionError("must not be called")))
    worker._process(lease, maker)  # type: ignore[arg-type]
    assert worker.client.failed == [(7, "shard URI outside the run's shard store")]
    assert not target.exists()
