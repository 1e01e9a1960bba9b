"""Shards to batches, on a background thread, ahead of need.

The learner's loop only takes ready batches from a bounded queue; leasing, reading, checksum
verification and decompression happen here, while the learner computes. Each batch carries the
shard row range it came from, so the learner can say exactly which rows a delta trained on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from diloco.client import CoordinatorClient
from diloco.data.shard import ShardCorrupt, read_shard
from diloco.store import StoreError
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.prefetch")


@dataclass
class Batch:
    x: torch.Tensor  # [rows, seq_len] int64
    y: torch.Tensor  # [rows, seq_len] int64
    shard_id: int
    row_start: int
    row_end: int
    last_of_shard: bool  # no more rows of this shard follow: it can be released after the push

    @property
    def tokens(self) -> int:
        """Shard tokens consumed (rows × (seq_len + 1)), the unit the ledger counts in."""
        return (self.row_end - self.row_start) * (self.x.shape[1] + 1)


DONE = object()  # the coordinator has no more training data for us


class ShardPrefetcher:
    def __init__(self, client: CoordinatorClient, batch_size: int, max_batches: int, stop: threading.Event):
        self.client = client
        self.batch_size = batch_size
        self.stop = stop
        self.queue: queue.Queue[Batch | object] = queue.Queue(maxsize=max(1, max_batches))
        self.starved = threading.Event()  # the last lease said "wait": no data ready anywhere
        self._held: set[int] = set()
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """After `stop`: wait for the thread, so it is not inside gRPC or torch at exit."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def held_shards(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def release(self, shard_id: int) -> None:
        with self._lock:
            self._held.discard(shard_id)

    def lose(self, shard_id: int) -> None:
        """The lease ran out (we were silent too long): its queued rows are someone else's now."""
        with self._lock:
            self._held.discard(shard_id)
            self._lost.add(shard_id)

    def get(self, timeout_s: float) -> Batch | object | None:
        """A batch, DONE, or None when nothing arrived in time. Batches of lost shards are skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not (isinstance(item, Batch) and item.shard_id in self._lost):
                return item

    def _put(self, item: Batch | object) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                lease = self.client.call("LeaseShard", pb.LeaseShardRequest())
                if lease.done:
                    self._put(DONE)
                    return
                if lease.retry_after_s > 0:
                    self.starved.set()
                    self.stop.wait(lease.retry_after_s)
                    continue
                self.starved.clear()
                with self._lock:
                    self._held.add(lease.shard_id)
                try:
                    shard = read_shard(lease.uri, expected_checksum=lease.checksum)
                except (ShardCorrupt, StoreError) as e:
                    # The coordinator has the raw chunk reprocessed into a good shard.
                    log.warning("shard %d unreadable (%s); reported for reprocessing", lease.shard_id, e)
                    self.release(lease.shard_id)
                    self.client.call(
                        "ReportShard", pb.ReportShardRequest(shard_id=lease.shard_id, error=str(e))
                    )
                    continue
                self._enqueue(lease, shard.rows)
        except Exception:
            log.exception("prefetch thread failed")
            self._put(DONE)

    def _enqueue(self, lease: pb.LeaseShardReply, rows) -> None:
        tensor = torch.from_numpy(rows.astype("int64", copy=False))
        ranges = [(s.row_start, s.row_end) for s in lease.todo]
        for r, (a, b) in enumerate(ranges):
            for i in range(a, b, self.batch_size):
                j = min(i + self.batch_size, b)
                block = tensor[i:j]
                last = r == len(ranges) - 1 and j == b
                if not self._put(Batch(block[:, :-1], block[:, 1:], lease.shard_id, i, j, last)):
                    return
