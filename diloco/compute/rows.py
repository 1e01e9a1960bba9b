"""The shard rows a learner trained on that no merge has counted yet: pure bookkeeping.

Each inner step changes every fragment, so a row's effect reaches the global model only once each
fragment has been pushed after it. Rows wait in three places: `unpushed` (trained since the last
push), `awaiting` (pushed with some fragments, waiting for the others) and `resolved` (waiting for
nothing more: they ride on the next push, whatever fragment). Plain data, kept on local disk with
the rest of the learner's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.compute.batch import Batch
from diloco.coordinator.leases import normalise, overlaps


def each_row_once(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A push's spans naming each row once: a learner whose lease lapsed (silent too long, the
    coordinator stalled) and that leased the same shard again trains its unpushed rows again, and
    spans that overlap each other are refused as malformed, the whole push with them (measured:
    a fault-free run lost a push of 10 steps so). The rows count once; the steps stay as trained."""
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for shard_id, a, b in spans:
        by_shard.setdefault(shard_id, []).append((a, b))
    if not any(overlaps(ranges) for ranges in by_shard.values()):
        return spans  # the usual case, as it was
    return [(shard_id, a, b) for shard_id, ranges in by_shard.items() for a, b in normalise(ranges)]


@dataclass
class Unpushed:
    """Shard rows trained on since the last push: they ride on the next push, whatever fragment."""

    spans: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    _last: dict[int, int] = field(default_factory=dict)  # shard id -> index of its latest span

    def add(self, batch: Batch) -> None:
        # Spans of several shards interleave: extend the shard's own latest span when the rows follow on.
        for span in batch.spans:
            k = self._last.get(span.shard_id)
            if k is not None and self.spans[k][2] == span.row_start:
                self.spans[k] = (span.shard_id, self.spans[k][1], span.row_end)
            else:
                self._last[span.shard_id] = len(self.spans)
                self.spans.append((span.shard_id, span.row_start, span.row_end))
            if span.last_of_shard:
                self.released.append(span.shard_id)

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
    # The learner's time in inner steps when the group was made (at a push): once it waits for
    # nothing, every step up to then rides on pushes made, and a kill no longer loses it.
    busy_s: float = 0.0


def release_fragment(
    awaiting: list[AwaitingCover], fragment: int
) -> tuple[Unpushed, list[AwaitingCover], float]:
    """The groups stop waiting for `fragment` (it was just pushed, or just overwritten by its merge:
    what it held of the rows is then as far as they get, as for any row in the τ overlap).
    Returns the rows that now wait for nothing, the groups still waiting, and the time in inner
    steps up to which the completed groups keep the learner's work (0.0: none completed)."""
    done, kept = Unpushed(), 0.0
    for group in awaiting:
        group.waiting.discard(fragment)
        if not group.waiting:
            done.extend(group.rows)
            kept = max(kept, group.busy_s)
    return done, [g for g in awaiting if g.waiting], kept


def rows_to_carry(
    awaiting: list[AwaitingCover], fresh: Unpushed, pushed: int, fragments: int, busy_s: float = 0.0
) -> tuple[Unpushed, list[AwaitingCover], float]:
    """Fragment `pushed` is pushed now, `busy_s` into the learner's inner steps: the rows its push
    carries, the groups still waiting, and the time up to which the steps ride on pushes.

    `fresh` holds the rows trained since the previous push; from now on they wait for every
    fragment's push, this one included. Groups complete in the order they were made.
    """
    groups = (
        [*awaiting, AwaitingCover(fresh, set(range(fragments)), busy_s)]
        if fresh.spans or fresh.released
        else awaiting
    )
    return release_fragment(groups, pushed)


def span_tokens(spans: list[tuple[int, int, int]], per_row: dict[int, int]) -> int:
    """The tokens (the ledger's unit) of row spans, from what a row of each shard counts for; a
    shard not seen this life (resumed rows) counts like the others, as every shard of a run does."""
    per_row = dict(per_row)  # the training thread adds shards while a heartbeat reads
    fallback = max(per_row.values(), default=0)
    return sum((b - a) * per_row.get(sid, fallback) for sid, a, b in spans)


def copy_rows(rows: Unpushed) -> Unpushed:
    """A copy that later `add`s to the original do not change."""
    return Unpushed(list(rows.spans), list(rows.released), dict(rows._last))


@dataclass
class RowBook:
    """Where each trained row waits (see the module docstring)."""

    unpushed: Unpushed = field(default_factory=Unpushed)
    awaiting: list[AwaitingCover] = field(default_factory=list)
    resolved: Unpushed = field(default_factory=Unpushed)
    # Every step up to this time in inner steps rides on pushes made (goodput's kept work).
    kept_busy_s: float = 0.0

    def trained(self, batch: Batch) -> None:
        self.unpushed.add(batch)

    def carry(self, pushed: int, fragments: int, busy_s: float = 0.0) -> Unpushed:
        """Fragment `pushed` is pushed now, `busy_s` into the inner steps: the rows its push carries
        (their effect is in every fragment once it is sent)."""
        carried, self.awaiting, kept = rows_to_carry(self.awaiting, self.unpushed, pushed, fragments, busy_s)
        self.kept_busy_s = max(self.kept_busy_s, kept)
        self.unpushed = Unpushed()
        self.resolved.extend(carried)
        carried, self.resolved = self.resolved, Unpushed()
        return carried

    def overwritten(self, fragment: int) -> None:
        """Fragment `fragment` was overwritten by its merge: it holds no waiting rows up any more."""
        done, self.awaiting, kept = release_fragment(self.awaiting, fragment)
        self.kept_busy_s = max(self.kept_busy_s, kept)
        self.resolved.extend(done)

    def hand_in(self) -> None:
        """Training stops, and every fragment with steps is pushed now, one after another: every
        row rides on the first of those pushes (its cover completes within the hand-in; a fragment
        in flight holds the rows as far as they get, as an overwritten one does).

        Left to wait for their cover, the rows rode on the hand-in's last push, whose fragment the
        coordinator may credit nothing more: each push is credited ahead of its rows by the
        schedule, against the rows its learner holds, so a learner that trained steps twice (a
        resume) has no credit left for its last push. Refused, that push lost the rows it named;
        they went back to the pool, were trained again, pushed, refused (seen: a resumed learner
        that never ended). The first push is the fragment pushed longest ago (schedule.hand_in),
        credited least ahead."""
        for group in self.awaiting:
            self.resolved.extend(group.rows)
        self.resolved.extend(self.unpushed)
        self.awaiting, self.unpushed = [], Unpushed()

    def all_carried(self) -> bool:
        """Every row so far rides on a push already made: a kill now loses none of the steps."""
        return not self.awaiting

    def take_all(self) -> Unpushed:
        """Every row no push will carry now (the end of training): they go back to the pool."""
        out = Unpushed()
        for group in self.awaiting:
            out.extend(group.rows)
        out.extend(self.unpushed)
        out.extend(self.resolved)
        self.unpushed, self.awaiting, self.resolved = Unpushed(), [], Unpushed()
        return out

    def spans(self) -> list[tuple[int, int, int]]:
        """Every row span in the book."""
        return [*self.unpushed.spans, *(s for g in self.awaiting for s in g.rows.spans), *self.resolved.spans]

    def copy(self) -> RowBook:
        """A copy that later changes to this book do not reach (for the local state)."""
        return RowBook(
            copy_rows(self.unpushed),
            [AwaitingCover(copy_rows(g.rows), set(g.waiting), g.busy_s) for g in self.awaiting],
            copy_rows(self.resolved),
            self.kept_busy_s,
        )
