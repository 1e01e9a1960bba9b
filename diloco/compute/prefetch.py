"""Shards to batches, on background threads, ahead of need.

The learner's loop only takes ready batches from a bounded queue. Two stages fill it while the
learner computes:

    fetch thread:  lease a shard -> read it (through the local shard cache, from the store on a
                   miss) -> verify its checksum, decompress -> hand it over (one shard ahead)
    batch thread:  keep up to `mix` shards open; draw the next batch's rows from all of them
                   (diloco.compute.batch) -> the bounded queue

so the next shard is downloaded and decoded while batches of the open ones are trained on, even
when a shard holds many more batches than the queue (a single stage would lease the next shard
only once the last batch of the current one was queued). Drawing from several shards at once
matters for the model: a shard is one stretch of the corpus (a few neighbouring files), and H
steps on one stretch make a delta that knows only that stretch; a batch of one stretch's rows is
a noisier gradient than one of rows from all over. At most one decoded shard waits
beside the open ones, so a learner holds at most mix + 1 shard leases ahead of its queue. Each
batch carries the shard row ranges it came from, so the learner can say exactly which rows a delta
trained on.

With dealt shards (data.deal > 0) the batch order repeats exactly from run to run: the choice
among open shards is seeded by the run's seed and the learner's slot, and the batch stage waits for
a dealt shard that is on its way instead of going on with fewer open (which shards happen to be
open at a given batch would otherwise depend on timing).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable

import grpc

from diloco import store
from diloco.client import CoordinatorClient
from diloco.compute.batch import Batch, ShardRows, cut_batch
from diloco.compute.rpc_outcome import rpc_outcome
from diloco.coordinator.leases import subtract
from diloco.data.cache import ShardCache, read_shard_via
from diloco.data.shard import Shard, ShardCorrupt
from diloco.store import StoreError
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.prefetch")

# Longest the batch stage waits for a dealt shard on its way while it has others open.
DEALT_SHARD_WAIT_S = 10.0


# How often a held-back first lease asks whether it may go (lease_after).
LEASE_WAIT_POLL_S = 0.02


DONE = object()  # the coordinator has no more training data for us


class ShardPrefetcher:
    def __init__(
        self,
        client: CoordinatorClient,
        batch_size: int,
        max_batches: int,
        stop: threading.Event,
        cache: ShardCache | None = None,
        mix: int = 1,
        seed: int = 0,
        pin_memory: bool = False,
    ):
        self.client = client
        # Batches for a GPU wait in page-locked memory: their copy to the device is then
        # asynchronous (non_blocking), overlapped with the step before.
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.mix = max(1, mix)
        self.seed = seed
        self._rng = random.Random(seed)  # reseeded with the deal slot on the first dealt shard
        self._seeded_slot = 0
        # The fetcher's last answer was a shard or "your dealt shard is coming": worth waiting for.
        self._coming = threading.Event()
        self.stop = stop
        self.cache = cache
        self.queue: queue.Queue[Batch | object] = queue.Queue(maxsize=max(1, max_batches))
        self.starved = threading.Event()  # the last lease said "wait": no data ready anywhere
        # Decoded shards between the stages; a slot is taken before a lease and freed when the
        # batch stage has cut the shard's last batch, so at most mix + 1 are leased at once.
        self._ready: queue.Queue[tuple[pb.LeaseShardReply, int, object] | object] = queue.Queue()
        self._slot = threading.Semaphore(self.mix + 1)
        self._held: set[int] = set()
        # shard id -> the number of the lease its queued batches must carry to be trained on. A
        # lost lease is removed, so its queued rows are skipped, and a later lease of the same
        # shard (rows handed back to the pool come round again) gets a new number.
        self._live: dict[int, int] = {}
        # shard id -> rows this learner trained on in an earlier life and still holds unmerged
        # (diloco.compute.local_state): never cut into batches again, or a push would carry them twice.
        self._skip: dict[int, list[tuple[int, int]]] = {}
        # Rows this learner trained in this life and holds unmerged (set by the learner): a shard
        # whose lease lapsed while we trained on (a partition) can be leased to us again, and its
        # ledger counts those rows untrained until a push names them.
        self._unmerged: Callable[[], list[tuple[int, int, int]]] = list
        self._leases = 0
        # Until this holds, no lease is asked for (None: at once). A resumed learner's first lease
        # waits for its last life's leases to be given back (KeepsLocalState._resume_in_flight).
        self._may_lease: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self._fetcher = threading.Thread(target=self._fetch_loop, name="prefetch-fetch", daemon=True)
        self._batcher = threading.Thread(target=self._batch_loop, name="prefetch-batch", daemon=True)

    def start(self) -> None:
        self._fetcher.start()
        self._batcher.start()

    def join(self, timeout_s: float) -> None:
        """After `stop`: wait for the threads, so neither is inside gRPC or torch at exit."""
        deadline = time.monotonic() + timeout_s
        for thread in (self._fetcher, self._batcher):
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def lease_after(self, ready: Callable[[], bool]) -> None:
        """Lease no shard before `ready()` holds (asked every few tens of ms; once it has held, never
        again). Set before `start`."""
        self._may_lease = ready

    def _leasing(self) -> bool:
        ready = self._may_lease
        if ready is None:
            return True
        if not ready():
            return False
        self._may_lease = None
        return True

    def skip(self, spans: list[tuple[int, int, int]]) -> None:
        """Rows (shard, start, end) already trained on: left out of every later lease's batches."""
        with self._lock:
            for shard_id, a, b in spans:
                self._skip.setdefault(shard_id, []).append((a, b))

    def leave_out(self, unmerged: Callable[[], list[tuple[int, int, int]]]) -> None:
        """Rows `unmerged()` names (shard, start, end) are left out of every later lease's batches:
        trained again, they rode on later pushes that the coordinator refused as re-sent work (seen
        after a 60-s partition: twelve pushes in a row, each of 15-20 steps)."""
        self._unmerged = unmerged

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
            self._live.pop(shard_id, None)

    def ready(self) -> bool:
        """A batch (or DONE) is waiting: get() returns without waiting for data."""
        return not self.queue.empty()

    def get(self, timeout_s: float) -> Batch | object | None:
        """A batch, DONE, or None when nothing arrived in time. Rows of lost leases are left out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not isinstance(item, Batch):
                return item
            live = item.only(lambda span: self._is_live(span.shard_id, span.lease))
            if live is not None:
                return live

    def _is_live(self, shard_id: int, lease: int) -> bool:
        with self._lock:
            return self._live.get(shard_id) == lease

    def _put(self, q: queue.Queue, item: object) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    # -- stage 1: lease, read, verify, decode ---------------------------------------------------

    def _fetch_loop(self) -> None:
        try:
            while not self.stop.is_set():
                if not self._leasing():
                    self.stop.wait(LEASE_WAIT_POLL_S)
                    continue
                if not self._slot.acquire(timeout=0.2):
                    continue
                item = self._fetch_one()
                if item is None:
                    self._slot.release()
                    continue
                self._ready.put(item)
                if item is DONE:
                    return
        except Exception as e:
            if self.stop.is_set() or self.client.stopping:
                # The learner left while a lease call was in flight: its end, not a failure.
                log.debug("prefetch fetch thread ends with the learner: %s", e)
            elif isinstance(e, grpc.RpcError):  # a refusal the client does not retry (a revoked certificate)
                log.error("no more shards: %s", rpc_outcome(e.code(), e.details()).reason)
            else:
                log.exception("prefetch fetch thread failed")
            self._ready.put(DONE)

    def _fetch_one(self) -> tuple[pb.LeaseShardReply, int, object] | object | None:
        """The next leased and decoded shard, DONE, or None (nothing this time)."""
        lease = self.client.lease_shard()
        if lease.done:
            return DONE
        if lease.retry_after_s > 0:
            if lease.dealt_shard_coming:
                self._coming.set()
            else:
                self._coming.clear()
                self.starved.set()
            self.stop.wait(lease.retry_after_s)
            return None
        self.starved.clear()
        self._coming.set()
        with self._lock:
            self._held.add(lease.shard_id)
            self._leases += 1
            number = self._live[lease.shard_id] = self._leases
        if not self._in_store(lease.uri):
            log.error("shard %d: %r is outside the run's shard store; not read", lease.shard_id, lease.uri)
            self.release(lease.shard_id)
            return None
        try:
            shard = read_shard_via(self.cache, lease.uri, lease.checksum)
        except (ShardCorrupt, StoreError) as e:
            # The coordinator has the raw chunk reprocessed into a good shard.
            log.warning("shard %d unreadable (%s); reported for reprocessing", lease.shard_id, e)
            self.release(lease.shard_id)
            try:
                self.client.report_shard(lease.shard_id, str(e))
            except grpc.RpcError as refused:  # e.g. more reports than the coordinator takes an hour
                if refused.code() not in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    raise
                log.warning(
                    "shard %d: report not taken (%s); its lease lapses instead",
                    lease.shard_id,
                    refused.details(),
                )
            return None
        return lease, number, shard

    def _in_store(self, uri: str) -> bool:
        """A shard URI the coordinator names lies under the run's store (it could name any file
        this learner can read, and its cache would keep a copy)."""
        root = self.client.config.data.store if self.client.config else ""
        return not root or store.uri_under(uri, store.shard_root(root))

    # -- stage 2: rows to batches ---------------------------------------------------------------

    def _batch_loop(self) -> None:
        open_shards: list[ShardRows] = []
        done = False
        try:
            while not self.stop.is_set():
                # Shards cut to the end, or whose lease was lost meanwhile: room for the next ones.
                for shard in [s for s in open_shards if not s.left or not self._is_live(s.shard_id, s.lease)]:
                    open_shards.remove(shard)
                    self._slot.release()
                # Take in decoded shards while there is room; wait for one only when none is open.
                waited_since = time.monotonic()
                while not done and len(open_shards) < self.mix:
                    # Dealt shards: a shard on its way is waited for, so the mix does not depend on
                    # timing; but only so long (the coordinator may be down: training goes on).
                    wait = not open_shards or (self._seeded_slot > 0 and self._coming.is_set())
                    try:
                        item = self._ready.get(timeout=0.2) if wait else self._ready.get_nowait()
                    except queue.Empty:
                        if not open_shards or not wait or self.stop.is_set():
                            break
                        if time.monotonic() - waited_since > DEALT_SHARD_WAIT_S:
                            log.info("dealt shard still not here after %.0fs; going on", DEALT_SHARD_WAIT_S)
                            self._coming.clear()
                            break
                        continue
                    if item is DONE:
                        done = True
                    else:
                        lease = item[0]  # type: ignore[index]
                        if lease.deal_slot and lease.deal_slot != self._seeded_slot:
                            self._seeded_slot = lease.deal_slot
                            self._rng.seed(f"{self.seed}/{lease.deal_slot}")
                        open_shards.append(self._rows(*item))  # type: ignore[misc]
                batch = cut_batch(self._rng, open_shards, self.batch_size, self.pin_memory)
                if batch is None:
                    if done and not open_shards:
                        self._put(self.queue, DONE)
                        return
                    continue
                if not self._put(self.queue, batch):
                    return
        except Exception:
            log.exception("prefetch batch thread failed")
            self._put(self.queue, DONE)

    def _rows(self, lease: pb.LeaseShardReply, number: int, shard: Shard) -> ShardRows:
        """The leased rows of a shard, less those trained in an earlier life or unmerged in this one."""
        with self._lock:
            done = list(self._skip.get(lease.shard_id, ()))
        done += [(a, b) for sid, a, b in self._unmerged() if sid == lease.shard_id]
        ranges = [r for s in lease.todo for r in subtract((s.row_start, s.row_end), done)]
        return ShardRows(shard, lease.shard_id, number, ranges)
