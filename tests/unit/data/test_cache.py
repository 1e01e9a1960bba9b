"""The learner's local shard cache, and the two-stage prefetcher that reads through it."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from diloco import store
from diloco.compute.batch import Batch, RowSpan
from diloco.compute.prefetch import DONE, ShardPrefetcher
from diloco.data.cache import (
    STALE_TMP_S,
    ShardCache,
    default_cache_dir,
    lru_evictions,
    open_cache,
    read_shard_via,
    stale_temporaries,
)
from diloco.data.shard import ShardCorrupt, encode_shard, write_shard
from diloco.v1 import coordinator_pb2 as pb


def rows_for(seed: int, n: int = 40, width: int = 17) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 257, size=(n, width)).astype(np.uint16)


def remote_shard(seed: int, n: int = 40) -> tuple[str, str, np.ndarray]:
    """A shard on a store that is not local (fsspec's in-memory filesystem): what S3 looks like."""
    rows = rows_for(seed, n)
    uri = f"memory://diloco-test-{uuid.uuid4().hex}/shard-{seed}.shard"
    info = write_shard(uri, rows, tokenizer_id="byte", vocab_size=257, chunk_index=seed)
    return uri, info.checksum, rows


def cached_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_a_read_is_fetched_once_then_served_from_the_cache(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    uri, checksum, rows = remote_shard(1)
    assert np.array_equal(cache.read(uri, checksum).rows, rows)
    assert (cache.stats.misses, cache.stats.hits) == (1, 0)
    store.remove(uri)  # the store's copy is gone: only the cache can answer now
    assert np.array_equal(cache.read(uri, checksum).rows, rows)
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    assert [n for n in cached_files(tmp_path / "cache") if ".tmp-" in n] == []


def test_size_limit_evicts_the_least_recently_used(tmp_path: Path) -> None:
    shards = [remote_shard(seed) for seed in range(3)]
    one = store.size(shards[0][0])
    cache = ShardCache(tmp_path / "cache", int(2.5 * one))  # room for two
    a, b, c = shards
    cache.read(a[0], a[1])
    time.sleep(0.02)
    cache.read(b[0], b[1])
    time.sleep(0.02)
    cache.read(a[0], a[1])  # a hit: a is now the most recently used
    time.sleep(0.02)
    cache.read(c[0], c[1])  # over the limit: b goes
    assert cache.size_bytes() <= cache.max_bytes
    kept = {p.name for _, _, p in cache.entries()}
    assert kept == {cache.path_for(a[0], a[1]).name, cache.path_for(c[0], c[1]).name}
    assert cache.stats.evicted == 1
    store.remove(b[0])
    with pytest.raises(store.StoreError):  # b really is gone from the cache
        cache.read(b[0], b[1])


def test_a_shard_larger_than_the_limit_is_read_but_not_kept(tmp_path: Path) -> None:
    uri, checksum, rows = remote_shard(4, n=200)
    cache = ShardCache(tmp_path / "cache", 100)
    assert np.array_equal(cache.read(uri, checksum).rows, rows)
    assert cached_files(tmp_path / "cache") == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_corrupt_cached_copy_is_deleted_and_fetched_again(tmp_path: Path, damage: str) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    uri, checksum, rows = remote_shard(5)
    cache.read(uri, checksum)
    path = cache.path_for(uri, checksum)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:  # a whole, valid shard, but not the one the coordinator named
        data = bytearray(encode_shard(rows_for(99), tokenizer_id="byte", vocab_size=257, chunk_index=0)[0])
    path.write_bytes(bytes(data))
    shard = cache.read(uri, checksum)
    assert np.array_equal(shard.rows, rows)  # the store's good copy, never the damaged one
    assert (cache.stats.corrupt, cache.stats.misses) == (1, 2)
    assert path.read_bytes() == store.read_bytes(uri)  # and the cache holds a good copy again


def test_a_corrupt_store_copy_raises_and_is_not_cached(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    uri, checksum, _ = remote_shard(6)
    data = bytearray(store.read_bytes(uri))
    data[-5] ^= 0xFF
    store.write_bytes_atomic(uri, bytes(data))
    with pytest.raises(ShardCorrupt, match="shard-6"):
        cache.read(uri, checksum)
    assert cached_files(tmp_path / "cache") == []


def test_a_local_store_is_read_in_place_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = open_cache("", 1 << 20)
    assert cache is not None and cache.remote_only
    assert cache.directory == default_cache_dir() == tmp_path / "xdg" / "diloco" / "shards"
    rows = rows_for(7)
    local = str(tmp_path / "store" / "s.shard")
    info = write_shard(local, rows, tokenizer_id="byte", vocab_size=257, chunk_index=0)
    assert np.array_equal(read_shard_via(cache, local, info.checksum).rows, rows)
    assert not cache.directory.exists()  # nothing copied, not even a directory made
    uri, checksum, _ = remote_shard(8)
    read_shard_via(cache, uri, checksum)
    assert len(cached_files(cache.directory)) == 1  # a remote one is cached
    # An explicit directory caches local shards too; "off" and 0 bytes mean no cache.
    explicit = open_cache(str(tmp_path / "fast"), 1 << 20)
    assert explicit is not None and not explicit.remote_only
    explicit.read(local, info.checksum)
    assert len(cached_files(tmp_path / "fast")) == 1
    assert open_cache("off", 1 << 20) is None and open_cache("", 0) is None
    assert np.array_equal(read_shard_via(None, local, info.checksum).rows, rows)


def test_an_unwritable_cache_directory_is_survived(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = ShardCache(blocker / "cache", 1 << 20)
    uri, checksum, rows = remote_shard(9)
    for _ in range(2):
        assert np.array_equal(cache.read(uri, checksum).rows, rows)
    assert cache.stats.misses == 2


def test_concurrent_writers_and_readers_only_ever_see_whole_copies(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    blobs = {f"memory://k/{i}": os.urandom(3000 + 500 * i) for i in range(4)}
    # Several caches on one directory (as learner processes share one), a limit of about two
    # blobs, so writes, hits and evictions interleave.
    caches = [ShardCache(directory, 8000) for _ in range(4)]
    seen_bad: list[str] = []
    stop = time.monotonic() + 1.0

    def work(i: int) -> None:
        cache = caches[i]
        rng = np.random.default_rng(i)
        while time.monotonic() < stop:
            key = list(blobs)[int(rng.integers(len(blobs)))]
            got = cache.get(key, "sum")
            if got is not None and got != blobs[key]:
                seen_bad.append(key)
            cache.put(key, "sum", blobs[key])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(caches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen_bad == []
    caches[0].evict()
    assert caches[0].size_bytes() <= 8000
    assert [n for n in cached_files(directory) if ".tmp-" in n] == []


def test_stale_temporary_files_of_a_dead_writer_are_removed(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    (tmp_path / "cache").mkdir()
    stale = tmp_path / "cache" / "abc.shard.tmp-1-deadbeef"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / "cache" / "def.shard.tmp-2-cafecafe"  # a writer at work right now
    fresh.write_bytes(b"partial")
    cache.put("memory://x/y", "sum", b"whole")
    assert not stale.exists() and fresh.exists()


# -- the prefetcher ------------------------------------------------------------------------------


class FakeCoordinator:
    """LeaseShard from a fixed list of shards, then done; records every call."""

    config = None  # no join: the prefetcher has no store root to check shard URIs against

    def __init__(self, shards: list[tuple[str, str, np.ndarray]], done_when_empty: bool = True):
        self.shards = list(enumerate(shards, start=1))
        self.done_when_empty = done_when_empty  # else: "retry later", as while others still train
        self.leased: list[int] = []
        self.reported: list[int] = []
        self.lock = threading.Lock()

    def report_shard(self, shard_id: int, error: str) -> pb.ReportShardReply:
        with self.lock:
            self.reported.append(shard_id)
            return pb.ReportShardReply()

    def lease_shard(self) -> pb.LeaseShardReply:
        with self.lock:
            if not self.shards:
                if self.done_when_empty:
                    return pb.LeaseShardReply(done=True)
                return pb.LeaseShardReply(retry_after_s=0.05)
            shard_id, (uri, checksum, rows) = self.shards.pop(0)
            self.leased.append(shard_id)
            return pb.LeaseShardReply(
                shard_id=shard_id,
                uri=uri,
                checksum=checksum,
                rows=len(rows),
                todo=[pb.ShardSpan(shard_id=shard_id, row_start=0, row_end=len(rows))],
            )


def run_to_done(coordinator: FakeCoordinator, **options) -> tuple[ShardPrefetcher, list[Batch]]:
    """A prefetcher over the fake coordinator, drained to DONE and stopped."""
    stop = threading.Event()
    prefetcher = ShardPrefetcher(coordinator, batch_size=8, stop=stop, **options)
    prefetcher.start()
    try:
        return prefetcher, drain(prefetcher)
    finally:
        stop.set()
        prefetcher.join(5)


def drain(prefetcher: ShardPrefetcher) -> list[Batch]:
    out: list[Batch] = []
    while True:
        item = prefetcher.get(timeout_s=5.0)
        assert item is not None, "prefetcher stalled"
        if item is DONE:
            return out
        assert isinstance(item, Batch)
        out.append(item)


def parts(batches: list[Batch], shard_id: int) -> list[tuple[RowSpan, torch.Tensor]]:
    """Each span of one shard, with its rows of input_ids, in the order the batches came."""
    out = []
    for b in batches:
        at = 0
        for span in b.spans:
            if span.shard_id == shard_id:
                out.append((span, b.columns["input_ids"][at : at + span.rows]))
            at += span.rows
    return out


def shards_in(batches: list[Batch]) -> set[int]:
    return {span.shard_id for b in batches for span in b.spans}


def test_prefetcher_reads_one_shard_ahead_through_the_cache(tmp_path: Path) -> None:
    shards = [remote_shard(seed, n=64) for seed in range(4)]
    coordinator = FakeCoordinator(shards)
    stop = threading.Event()
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    prefetcher = ShardPrefetcher(coordinator, batch_size=8, max_batches=2, stop=stop, cache=cache)
    prefetcher.start()
    try:
        deadline = time.monotonic() + 5
        while len(coordinator.leased) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        # The queue (2 batches) is full of shard 1; shard 2 is read and waits; nothing more is leased.
        assert coordinator.leased == [1, 2]
        assert prefetcher.held_shards() == [1, 2]
        batches = drain(prefetcher)
    finally:
        stop.set()
        prefetcher.join(5)
    assert coordinator.leased == [1, 2, 3, 4]
    assert all(len(b.spans) == 1 for b in batches)  # mix = 1: a batch is one shard's rows
    for shard_id, (_, _, rows) in enumerate(shards, start=1):
        got = parts(batches, shard_id)
        assert np.array_equal(np.concatenate([r for _, r in got]), rows.astype(np.int64))
        assert [span.last_of_shard for span, _ in got] == [False] * 7 + [True]
    assert cache.stats.misses == 4 and len(cached_files(tmp_path / "cache")) == 4


def test_prefetcher_skips_a_lost_lease_but_trains_a_later_lease_of_the_same_shard(tmp_path: Path) -> None:
    uri, checksum, rows = remote_shard(11, n=64)
    coordinator = FakeCoordinator([(uri, checksum, rows)], done_when_empty=False)
    stop = threading.Event()
    prefetcher = ShardPrefetcher(coordinator, batch_size=8, max_batches=1, stop=stop)
    prefetcher.start()
    try:
        first = prefetcher.get(timeout_s=5.0)
        assert isinstance(first, Batch) and shards_in([first]) == {1}
        prefetcher.lose(1)  # the lease ran out: queued rows of shard 1 are someone else's
        with coordinator.lock:  # ... and it comes back to us later, whole
            coordinator.shards.append((1, (uri, checksum, rows)))
            coordinator.done_when_empty = True
        batches = drain(prefetcher)
    finally:
        stop.set()
        prefetcher.join(5)
    # Nothing more of the lost lease reached the learner; the new lease's rows all did, once.
    got = parts(batches, 1)
    assert shards_in(batches) == {1} and all(span.lease != first.spans[0].lease for span, _ in got)
    assert [span.row_start for span, _ in got] == list(range(0, 64, 8))
    assert prefetcher.held_shards() == [1]


def test_prefetcher_reports_a_corrupt_shard_and_goes_on(tmp_path: Path) -> None:
    bad_uri, bad_checksum, _ = remote_shard(12)
    data = bytearray(store.read_bytes(bad_uri))
    data[-3] ^= 0xFF
    store.write_bytes_atomic(bad_uri, bytes(data))
    good = remote_shard(13, n=16)
    coordinator = FakeCoordinator([(bad_uri, bad_checksum, rows_for(12)), good])
    prefetcher, batches = run_to_done(coordinator, max_batches=4)
    assert coordinator.reported == [1]
    assert shards_in(batches) == {2} and prefetcher.held_shards() == [2]


class RefusedReport(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "at most 16 shard reports an hour"


def test_a_report_the_coordinator_does_not_take_still_lets_the_prefetcher_go_on(tmp_path: Path) -> None:
    """A learner whose reports are refused (more than the coordinator takes an hour: its own disk
    failing) trains on: the refusal was taken for the end of its data."""
    bad_uri, bad_checksum, _ = remote_shard(14)
    data = bytearray(store.read_bytes(bad_uri))
    data[-3] ^= 0xFF
    store.write_bytes_atomic(bad_uri, bytes(data))
    coordinator = FakeCoordinator([(bad_uri, bad_checksum, rows_for(14)), remote_shard(15, n=16)])

    def refuse(shard_id: int, error: str) -> pb.ReportShardReply:
        raise RefusedReport()

    coordinator.report_shard = refuse  # type: ignore[method-assign]
    prefetcher, batches = run_to_done(coordinator, max_batches=4)
    assert shards_in(batches) == {2} and prefetcher.held_shards() == [2]


def test_prefetcher_mixes_rows_of_several_shards_in_a_batch_and_delivers_each_row_once(
    tmp_path: Path,
) -> None:
    shards = [remote_shard(20 + seed, n=64) for seed in range(5)]
    coordinator = FakeCoordinator(shards)
    _, batches = run_to_done(coordinator, max_batches=4, mix=3)
    # A batch is rows of several stretches of data, as a shuffled baseline's is (all but the
    # first, cut before a second shard is open, and the tail, when one is left).
    mixed = [b for b in batches if len({span.shard_id for span in b.spans}) >= 2]
    assert len(mixed) >= len(batches) // 2, [len(b.spans) for b in batches]
    assert sum(len(b.columns["input_ids"]) for b in batches) == 5 * 64
    # A short batch only where every open shard ran short at once (before, every shard's end).
    assert sum(len(b.columns["input_ids"]) != 8 for b in batches) <= len(shards)
    for shard_id, (_, _, rows) in enumerate(shards, start=1):
        got = parts(batches, shard_id)
        # Each shard's rows come in order, in contiguous spans, once; the last span says so.
        assert [span.row_start for span, _ in got] == [0] + [span.row_end for span, _ in got[:-1]]
        assert got[-1][0].row_end == 64
        assert np.array_equal(np.concatenate([r for _, r in got]), rows.astype(np.int64))
        assert [span.last_of_shard for span, _ in got] == [False] * (len(got) - 1) + [True]


def test_eviction_takes_the_least_recently_used_first_and_never_the_copy_just_written() -> None:
    a, b, c = Path("a.shard"), Path("b.shard"), Path("c.shard")
    entries = [(1.0, 40, a), (2.0, 40, b), (3.0, 40, c)]  # least recently used first
    assert lru_evictions(entries, 100, keep=None) == [a]
    assert lru_evictions(entries, 80, keep=None) == [a]
    assert lru_evictions(entries, 79, keep=None) == [a, b]
    assert lru_evictions(entries, 79, keep=a) == [b, c]  # the new copy stays, however old its mtime
    assert lru_evictions(entries, 120, keep=None) == []


def test_only_temporary_files_older_than_an_hour_are_stale() -> None:
    now = 10_000.0
    listing = [
        (now - STALE_TMP_S - 1, 5, Path("x.shard.tmp-1-dead")),
        (now - 10, 5, Path("y.shard.tmp-2-live")),  # a writer at work
        (now - STALE_TMP_S - 1, 5, Path("z.shard")),  # an old copy is evicted by size, not age
    ]
    assert stale_temporaries(listing, now) == [Path("x.shard.tmp-1-dead")]
