"""The rows a learner trained on since its last push: exact spans, whatever order batches come in."""

from __future__ import annotations

import torch

from diloco.compute.learner import Unpushed
from diloco.compute.prefetch import Batch


def batch(shard: int, start: int, end: int, last: bool = False) -> Batch:
    rows = torch.zeros((end - start, 4), dtype=torch.int64)
    return Batch(rows, rows, shard, start, end, last)


def test_interleaved_shards_keep_one_span_each_while_rows_follow_on() -> None:
    u = Unpushed()
    for b in (
        batch(7, 0, 8),
        batch(9, 16, 24),
        batch(7, 8, 16),
        batch(9, 24, 32, last=True),
        batch(7, 16, 20),
    ):
        u.add(b)
    assert u.spans == [(7, 0, 20), (9, 16, 32)]
    assert u.released == [9]


def test_a_gap_starts_a_new_span() -> None:
    u = Unpushed()
    for b in (batch(3, 0, 8), batch(3, 40, 48), batch(3, 48, 56)):
        u.add(b)
    assert u.spans == [(3, 0, 8), (3, 40, 56)]
