"""A shard leased again (its lease lapsed while the learner trained on, cut off from the coordinator)
is cut into batches without the rows the learner trained and holds unmerged: trained twice, they
rode on later pushes the coordinator refused as re-sent work."""

from __future__ import annotations

import threading

import numpy as np

from diloco.compute.prefetch import ShardPrefetcher
from diloco.data.shard import Shard
from diloco.v1 import coordinator_pb2 as pb


def lease(shard_id: int, *todo: tuple[int, int]) -> pb.LeaseShardReply:
    reply = pb.LeaseShardReply(shard_id=shard_id)
    for a, b in todo:
        reply.todo.add(shard_id=shard_id, row_start=a, row_end=b)
    return reply


def shard(rows: int) -> Shard:
    return Shard(
        {"rows": rows, "tokens": rows * 5, "seq_len": 4}, {"input_ids": np.zeros((rows, 5), np.int64)}
    )


def test_rows_held_unmerged_are_left_out_of_a_later_lease_of_their_shard() -> None:
    prefetcher = ShardPrefetcher(None, batch_size=4, max_batches=2, stop=threading.Event())  # type: ignore[arg-type]
    unmerged = [(9, 0, 160), (9, 200, 240), (10, 0, 50)]  # the row book and pushes in flight
    prefetcher.leave_out(lambda: list(unmerged))
    rows = prefetcher._rows(lease(9, (0, 341)), 1, shard(341))
    assert list(rows._ranges) == [(160, 200), (240, 341)] and rows.left == 141
    unmerged.clear()  # named and merged since: the ledger's todo no longer lists them anyway
    assert list(prefetcher._rows(lease(9, (0, 341)), 2, shard(341))._ranges) == [(0, 341)]


def test_a_shard_whose_todo_this_learner_holds_entirely_gives_no_rows() -> None:
    prefetcher = ShardPrefetcher(None, batch_size=4, max_batches=2, stop=threading.Event())  # type: ignore[arg-type]
    prefetcher.leave_out(lambda: [(3, 0, 100)])
    assert prefetcher._rows(lease(3, (40, 100)), 1, shard(100)).left == 0
