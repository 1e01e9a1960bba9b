"""A training batch, and how its rows are drawn from the shards a learner has open.

A shard is one stretch of the corpus (a few neighbouring files packed into rows), so a batch cut
from one shard is rows of one stretch: its gradient is noisier than a batch of rows from all over,
which is what a data-parallel baseline trains on. A batch here is drawn row by row from every open
shard (`draw_counts`), and each shard gives its rows as one contiguous range (a `RowSpan`), so the
learner still says exactly which rows a delta trained on: exactly-once accounting is by spans,
however many a batch holds.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diloco.data.shard import Shard
from diloco.model.contract import column_tensor


@dataclass(frozen=True)
class RowSpan:
    """Rows [row_start, row_end) of one leased shard, as one part of a batch."""

    shard_id: int
    row_start: int
    row_end: int
    last_of_shard: bool = False  # no more rows of this shard follow: it can be released after the push
    lease: int = 0  # which of this learner's leases on the shard the rows came with
    # What a row counts for in the ledger: seq_len + 1 tokens, or 1 (a sample); 0: the width of
    # the batch's input_ids (token rows).
    tokens_per_row: int = 0

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass
class Batch:
    columns: dict[str, torch.Tensor]  # the model's input: one row per sample, by column name
    spans: tuple[RowSpan, ...]  # where the rows came from, in the columns' row order

    @classmethod
    def of_shard(
        cls, columns: dict[str, torch.Tensor], shard_id: int, row_start: int, row_end: int, last: bool = False
    ) -> Batch:
        """A batch of one shard's rows (tests, and models fed one stretch at a time)."""
        return cls(columns, (RowSpan(shard_id, row_start, row_end, last),))

    def per_row(self, span: RowSpan) -> int:
        """Ledger tokens one row of `span` counts for."""
        return span.tokens_per_row or int(self.columns["input_ids"].shape[1])

    @property
    def tokens(self) -> int:
        """Shard tokens consumed (rows × (seq_len + 1), or rows of samples): the ledger's unit."""
        return sum(s.rows * self.per_row(s) for s in self.spans)

    def only(self, keep: Callable[[RowSpan], bool]) -> Batch | None:
        """This batch without the spans `keep` refuses (their lease was lost: the rows are someone
        else's now); None when no span is left."""
        kept = [keep(s) for s in self.spans]  # asked once: a lease may be lost between two asks
        if all(kept):
            return self
        if not any(kept):
            return None
        starts = np.cumsum([0, *(s.rows for s in self.spans)])
        index = torch.from_numpy(
            np.concatenate([np.arange(starts[i], starts[i + 1]) for i, k in enumerate(kept) if k])
        )
        spans = tuple(s for s, k in zip(self.spans, kept, strict=True) if k)
        return Batch({name: t.index_select(0, index) for name, t in self.columns.items()}, spans)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: t.to(device, non_blocking=True) for name, t in self.columns.items()}


class ShardRows:
    """The rows of one leased shard not yet cut into batches, in order."""

    def __init__(self, shard: Shard, shard_id: int, lease: int, ranges: list[tuple[int, int]]):
        self.shard = shard
        self.shard_id = shard_id
        self.lease = lease
        self.tokens_per_row = shard.header["tokens"] // max(1, shard.header["rows"])
        self._ranges = deque((a, b) for a, b in ranges if b > a)
        self.left = sum(b - a for a, b in self._ranges)

    def take(self, n: int) -> list[tuple[RowSpan, dict[str, np.ndarray]]]:
        """The next `n` rows (fewer at the end), as spans with their column slices."""
        out = []
        while n > 0 and self._ranges:
            a, b = self._ranges[0]
            j = min(a + n, b)
            if j == b:
                self._ranges.popleft()
            else:
                self._ranges[0] = (j, b)
            span = RowSpan(self.shard_id, a, j, not self._ranges, self.lease, self.tokens_per_row)
            out.append((span, {name: c[a:j] for name, c in self.shard.columns.items()}))
            self.left -= j - a
            n -= j - a
        return out


def draw_counts(rng: random.Random, left: list[int], batch_size: int) -> list[int]:
    """How many rows each open shard gives the next batch: each row from a shard chosen at random
    among those with rows to spare (so a batch mixes every open stretch, in proportions that vary
    from batch to batch as a random sample's would). Fewer than batch_size only when the open
    shards hold fewer rows."""
    counts = [0] * len(left)
    for _ in range(batch_size):
        spare = [k for k, n in enumerate(left) if n > counts[k]]
        if not spare:
            break
        counts[rng.choice(spare)] += 1
    return counts


def cut_batch(
    rng: random.Random, open_shards: list[ShardRows], batch_size: int, pin_memory: bool = False
) -> Batch | None:
    """The next batch drawn from the open shards (None: they are used up)."""
    counts = draw_counts(rng, [s.left for s in open_shards], batch_size)
    parts = [part for shard, n in zip(open_shards, counts, strict=True) if n for part in shard.take(n)]
    if not parts:
        return None
    columns = {}
    for name in parts[0][1]:
        pieces = [cols[name] for _, cols in parts]
        column = column_tensor(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
        columns[name] = column.pin_memory() if pin_memory else column
    return Batch(columns, tuple(span for span, _ in parts))
