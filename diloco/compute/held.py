"""What a learner holds between pushes: each fragment's base and counters, and the shard rows
trained on that no merge has counted yet. Plain data, so it can be kept on local disk
(diloco.compute.local_state) and a restarted learner can go on from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.compute.prefetch import Batch
from diloco.v1 import coordinator_pb2 as pb


@dataclass
class HeldFragment:
    """What a learner holds of one fragment."""

    names: list[str]
    version: int = -1
    base: dict[str, torch.Tensor] = field(default_factory=dict)  # Θ_p as last received (CPU fp32)
    steps: int = 0  # inner steps since Θ_p was received
    tokens: int = 0
    loss_sum: float = 0.0
    in_flight: bool = False  # pushed; its merged result has not been applied yet
    apply_at: int = 0  # inner step from which the merged result is applied
    # sync.keep_overlap: θ_p and the counters as they were at the push, so the steps since
    # can be kept on top of the merged result.
    at_push: dict[str, torch.Tensor] = field(default_factory=dict)
    counted_at_push: tuple[int, int, float] = (0, 0, 0.0)
    # The push in flight (header with its push_id, and what it carries): kept on local disk, so a
    # restarted learner can ask about it again (diloco.compute.local_state).
    push: tuple[pb.TensorHeader, dict[str, torch.Tensor]] | None = None


@dataclass
class Unpushed:
    """Shard rows trained on since the last push: they ride on the next push, whatever fragment."""

    spans: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    _last: dict[int, int] = field(default_factory=dict)  # shard id -> index of its latest span

    def add(self, batch: Batch) -> None:
        # Batches of several shards interleave: extend the shard's own latest span when the rows follow on.
        k = self._last.get(batch.shard_id)
        if k is not None and self.spans[k][2] == batch.row_start:
            self.spans[k] = (batch.shard_id, self.spans[k][1], batch.row_end)
        else:
            self._last[batch.shard_id] = len(self.spans)
            self.spans.append((batch.shard_id, batch.row_start, batch.row_end))
        if batch.last_of_shard:
            self.released.append(batch.shard_id)

    def extend(self, other: Unpushed) -> None:
        for span in other.spans:
            self._last[span[0]] = len(self.spans)
            self.spans.append(span)
        self.released.extend(other.released)


@dataclass
class AwaitingCover:
    """Rows trained before a push, waiting for every other fragment's push to carry them too.

    Each inner step changes every fragment, so a row's effect reaches the global model only once
    each fragment has been pushed after it. Its span rides on the push that completes that set:
    a learner that dies in between leaves the rows unmerged (back to the pool), instead of
    counting them as trained while most of the model never saw them.
    """

    rows: Unpushed
    waiting: set[int]


def release_fragment(awaiting: list[AwaitingCover], fragment: int) -> tuple[Unpushed, list[AwaitingCover]]:
    """The groups stop waiting for `fragment` (it was just pushed, or just overwritten by its merge:
    what it held of the rows is then as far as they get, as for any row in the τ overlap).
    Returns the rows that now wait for nothing and the groups still waiting."""
    done = Unpushed()
    for group in awaiting:
        group.waiting.discard(fragment)
        if not group.waiting:
            done.extend(group.rows)
    return done, [g for g in awaiting if g.waiting]


def rows_to_carry(
    awaiting: list[AwaitingCover], fresh: Unpushed, pushed: int, fragments: int
) -> tuple[Unpushed, list[AwaitingCover]]:
    """Fragment `pushed` is pushed now: the rows its push carries, and the groups still waiting.

    `fresh` holds the rows trained since the previous push; from now on they wait for every
    fragment's push, this one included. Groups complete in the order they were made.
    """
    groups = (
        [*awaiting, AwaitingCover(fresh, set(range(fragments)))]
        if fresh.spans or fresh.released
        else awaiting
    )
    return release_fragment(groups, pushed)


def copy_rows(rows: Unpushed) -> Unpushed:
    """A copy that later `add`s to the original do not change."""
    return Unpushed(list(rows.spans), list(rows.released), dict(rows._last))
