"""A resumed learner gives back its last life's shard leases, never this life's (_resume_in_flight).

The ledger releases a shard by shard id and worker id, and a resumed learner has its last life's
worker id. After a SIGTERM (its Leave freed the leases) or a kill -9 whose leases ran out, the new
life can lease its old shard again at once; a release of the last life's leases landing after that
took the new lease, the shard was leased a second time with rows trained under the first still
unrecorded, and the pushes carrying them twice were refused as re-sent work (an operator's run).

The learner's real prefetcher and sync channel run here against a real ledger, through a client
that calls the ledger as the coordinator's handlers do. The replayed push streams for a while (as
a fragment's delta does), so a lease asked for meanwhile lands before the release."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diloco.compute import prefetch
from diloco.compute.prefetch import ShardPrefetcher
from diloco.compute.resume import answered_all
from diloco.compute.sync_channel import SyncChannel
from diloco.coordinator.ledger import Ledger, ShardLease
from diloco.data.shard import Shard
from diloco.v1 import coordinator_pb2 as pb
from tests.support import FakeClock, shard_row
from tests.unit.compute.test_keep_overlap import learner_with_one_tensor
from tests.unit.coordinator.ledger_setup import ROWS, TOKENS_PER_ROW, TTL, with_train_shard

WORKER = "l2"
STREAM_S = 0.5  # how long the replayed push streams, at most (until a lease is asked for)


class Coordinator:
    """The learner's client, answered by the ledger as the coordinator's handlers answer it."""

    def __init__(self, ledger: Ledger, stop: threading.Event):
        self.ledger, self.stop = ledger, stop
        self.worker_id, self.config, self.stopping, self.closed = WORKER, None, False, False
        self.leased = threading.Event()
        self.leases: list[tuple[int, list[tuple[int, int]]]] = []  # (shard id, rows to train) in turn
        self.released = threading.Event()

    def lease_shard(self) -> pb.LeaseShardReply:
        lease = self.ledger.lease_shard(WORKER, TTL)
        if not isinstance(lease, ShardLease):
            return pb.LeaseShardReply(retry_after_s=0.2)
        self.leases.append((lease.shard_id, list(lease.todo)))
        self.leased.set()
        return pb.LeaseShardReply(
            shard_id=lease.shard_id,
            uri=lease.uri,
            rows=lease.rows,
            todo=[pb.ShardSpan(shard_id=lease.shard_id, row_start=a, row_end=b) for a, b in lease.todo],
            lease_ttl_s=TTL,
        )

    def push(self, header: pb.TensorHeader, tensors: dict, retry_for_s: float | None = None) -> pb.PushReply:
        if not tensors and header.release_only:  # PushRPCs._accept_push
            self.ledger.release_shards(header.worker_id or WORKER, list(header.released_shards))
            self.released.set()
            return pb.PushReply(accepted=True, reason="shards released", version=header.version)
        self.leased.wait(STREAM_S)  # a delta takes a while to stream
        refusal = self.ledger.record_push(
            header.push_id,
            WORKER,
            header.fragment,
            header.version,
            header.inner_steps,
            header.tokens,
            [(s.shard_id, s.row_start, s.row_end) for s in header.spans],
            list(header.released_shards),
        )
        return pb.PushReply(
            accepted=refusal is None, reason=refusal or "queued for merge", version=header.version
        )

    def pull(self, *args, **kwargs) -> list:
        self.stop.wait(0.05)
        return []


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(str(tmp_path / "ledger.sqlite"), clock=FakeClock())
    yield led
    led.close()


def a_shard() -> Shard:
    return Shard(
        header={"rows": ROWS, "tokens": ROWS * TOKENS_PER_ROW},
        columns={"input_ids": np.zeros((ROWS, TOKENS_PER_ROW + 1), dtype=np.int64)},
    )


@pytest.mark.parametrize("last_life", ["left", "killed, its lease ran out", "killed, its lease live"])
def test_a_resumed_life_gives_back_only_its_last_lifes_leases(ledger, monkeypatch, last_life):
    monkeypatch.setattr(prefetch, "read_shard_via", lambda cache, uri, checksum=None: a_shard())
    old, _ = with_train_shard(ledger, ("train", "train"))
    ledger.join(WORKER, "compute", "h")
    assert ledger.lease_shard(WORKER, TTL).shard_id == old  # the last life's lease
    # It pushed rows [0, 4) of it (in flight at its end: replayed from the journal) and trained
    # rows [4, 6) since (in its local state, unpushed).
    in_flight = pb.TensorHeader(fragment=0, version=0, codec="fp32", inner_steps=4, push_id="journaled")
    in_flight.spans.add(shard_id=old, row_start=0, row_end=4)
    if last_life == "left":
        ledger.leave(WORKER)  # SIGTERM: the Leave frees its leases
    elif last_life == "killed, its lease ran out":
        ledger.clock.advance(TTL + 1)
    ledger.join(WORKER, "compute", "h")

    stop = threading.Event()
    client = Coordinator(ledger, stop)
    learner = learner_with_one_tensor(keep=True)
    learner.prefetcher = ShardPrefetcher(client, batch_size=2, max_batches=2, stop=stop)  # type: ignore[arg-type]
    learner.channel = SyncChannel(client, stop, pull_wait_s=0.1, held=lambda p: 0)  # type: ignore[arg-type]
    learner.frags[0].in_flight, learner.frags[0].push = True, (in_flight, {"w": torch.zeros(4)})
    state = SimpleNamespace(row_spans=lambda: [(old, 4, 6)], held_shards=[old])
    learner._resume_in_flight(state)  # type: ignore[arg-type]
    learner.prefetcher.start()  # in Learner._start's order
    learner.channel.start()
    try:
        assert client.released.wait(5), "the last life's leases were never given back"
        deadline = time.monotonic() + 5
        while not (client.leased.is_set() and answered_all(learner.channel)) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # anything still to land lands
        held = learner.prefetcher.held_shards()
        assert held, "this life leased nothing"
        # Every lease this life took is still its own in the ledger: none was lost to the release
        # (nor taken and leased to it again: the ledger never leases a shard to its holder).
        leased = [sid for sid, _ in client.leases]
        assert len(leased) == len(set(leased)), f"a shard of this life's was taken back: leases {leased}"
        assert ledger.renew(WORKER, [], held, TTL)[1] == []
        for sid in held:
            assert shard_row(ledger, sid)["holder"] == WORKER
        # A lease of the old shard leaves the replayed push's rows out: none is trained twice.
        assert all(b <= 0 or a >= 4 for sid, todo in client.leases if sid == old for a, b in todo)
    finally:
        stop.set()
        learner.prefetcher.join(5)
        learner.channel.join(5)
