"""A batch drawn row by row from the open shards: every shard gives one contiguous span, every row
goes out once, and a lost lease's rows are taken out of a batch already cut."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from diloco.compute.batch import Batch, RowSpan, ShardRows, cut_batch, draw_counts
from diloco.data.shard import Shard


def shard_rows(shard_id: int, rows: int, ranges: list[tuple[int, int]] | None = None) -> ShardRows:
    # Row r of shard s holds s * 1000 + r in every token, so a batch row says where it came from.
    ids = (shard_id * 1000 + np.arange(rows, dtype=np.uint16))[:, None].repeat(5, axis=1)
    shard = Shard({"tokens": rows * 5, "rows": rows}, {"input_ids": ids})
    return ShardRows(shard, shard_id, lease=shard_id, ranges=ranges or [(0, rows)])


@pytest.mark.parametrize("left", [[10, 10, 10], [1, 0, 30], [3, 2, 1], [0, 0, 0]])
def test_draw_counts_fill_the_batch_from_the_rows_there_are(left: list[int]) -> None:
    for seed in range(20):
        counts = draw_counts(random.Random(seed), left, 8)
        assert sum(counts) == min(8, sum(left))
        assert all(0 <= c <= n for c, n in zip(counts, left, strict=True))


def test_draw_counts_mix_every_open_shard_and_repeat_with_the_seed() -> None:
    draws = [draw_counts(random.Random(seed), [100, 100, 100, 100], 16) for seed in range(200)]
    # Each shard gives a quarter of the rows on average, and most batches hold all four.
    for k in range(4):
        assert 3.5 <= np.mean([d[k] for d in draws]) <= 4.5
    assert np.mean([all(d) for d in draws]) > 0.8
    assert draw_counts(random.Random(7), [100] * 4, 16) == draw_counts(random.Random(7), [100] * 4, 16)


def test_cut_batches_give_every_row_once_in_contiguous_spans() -> None:
    shards = [shard_rows(1, 23), shard_rows(2, 40, ranges=[(0, 5), (9, 40)]), shard_rows(3, 7)]
    rng, batches = random.Random(0), []
    while (batch := cut_batch(rng, shards, 8)) is not None:
        batches.append(batch)
    assert all(len(b.columns["input_ids"]) == 8 for b in batches[:-1])
    seen: dict[int, list[int]] = {}
    for b in batches:
        at = 0
        assert b.columns["input_ids"].dtype == torch.int64
        for span in b.spans:
            got = b.columns["input_ids"][at : at + span.rows, 0].tolist()
            assert got == [span.shard_id * 1000 + r for r in range(span.row_start, span.row_end)]
            seen.setdefault(span.shard_id, []).extend(got)
            at += span.rows
        assert at == len(b.columns["input_ids"])
        assert b.tokens == 5 * at  # the shard's tokens per row
    assert seen[1] == [1000 + r for r in range(23)]
    assert seen[2] == [2000 + r for r in [*range(5), *range(9, 40)]]  # the skipped rows never come
    assert seen[3] == [3000 + r for r in range(7)]
    last = [(span.shard_id, span.row_end) for b in batches for span in b.spans if span.last_of_shard]
    assert sorted(last) == [(1, 23), (2, 40), (3, 7)]


def test_a_lost_leases_rows_leave_the_batch_and_the_rest_stay_in_order() -> None:
    columns = {"input_ids": torch.arange(10)[:, None], "label": torch.arange(10) * 2}
    batch = Batch(columns, (RowSpan(1, 0, 3), RowSpan(2, 50, 54), RowSpan(3, 7, 10)))
    assert batch.only(lambda s: True) is batch
    assert batch.only(lambda s: False) is None
    kept = batch.only(lambda s: s.shard_id != 2)
    assert kept is not None and [s.shard_id for s in kept.spans] == [1, 3]
    assert kept.columns["input_ids"][:, 0].tolist() == [0, 1, 2, 7, 8, 9]
    assert kept.columns["label"].tolist() == [0, 2, 4, 14, 16, 18]


def test_each_span_is_asked_about_once_so_a_lease_lost_meanwhile_cannot_split_the_answer() -> None:
    batch = Batch(
        {"input_ids": torch.arange(6)[:, None]}, (RowSpan(1, 0, 2), RowSpan(2, 0, 2), RowSpan(3, 0, 2))
    )
    asked: list[int] = []

    def keep(span: RowSpan) -> bool:  # shard 1's lease is lost; shard 2's is lost after its first ask
        asked.append(span.shard_id)
        return span.shard_id == 3 or (span.shard_id == 2 and asked.count(2) == 1)

    kept = batch.only(keep)
    assert asked == [1, 2, 3]
    # The rows match the spans: those of the answer given, shards 2 and 3.
    assert kept is not None and [s.shard_id for s in kept.spans] == [2, 3]
    assert kept.columns["input_ids"][:, 0].tolist() == [2, 3, 4, 5]
