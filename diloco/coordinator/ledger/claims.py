"""What a push is credited with, decided before its delta streams: whose rows it names, and how
many steps and tokens those rows (and the rows its learner holds) can back.

Each row a learner trains moves every fragment once, so a row backs at most one push of each
fragment: over a worker's pushes of one fragment, the tokens credited never exceed the rows it
has named (in any fragment's push) plus the untrained rows of the shards it holds now. That is
the budget (`push_claim`) every push draws on; a push with rows is credited at most P times the fresh
rows it names, or those rows and P − 1 intervals of H/P steps if more (a steady learner names H/P
steps of rows per push, each push holding H steps: the rows of the oldest of the P intervals it
holds), and a push with none rides on its held rows, and on named rows this fragment was not
credited for (a hand-in's later pushes), only as one of the first P − 1 pushes after the worker's
last push with rows (a learner's first pushes, while its first rows wait for every fragment's push
to cover them: compute/rows.py). A push whose own fresh rows find the budget
spent (their training was credited ahead, to earlier pushes) is taken for its rows only: they are
recorded as trained, its delta merges nothing (`Claim.rows_only`), so no honest row is refused and
trained again."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from diloco.coordinator import leases
from diloco.coordinator.ledger.db import LedgerBase


@dataclass(frozen=True)
class Claim:
    """What a push is credited with (push_claim): its steps and tokens as the rows behind it
    allow, or why no rows back it at all (`refusal`, with the gRPC status it deserves)."""

    steps: int
    tokens: int
    refusal: str = ""
    denied: bool = False  # PERMISSION_DENIED (rows not the pusher's); else INVALID_ARGUMENT
    # Its own fresh rows, with no credit left for them: the rows are recorded, the delta not merged.
    rows_only: bool = False


class ClaimsTable(LedgerBase):
    def _not_leased(
        self, db: sqlite3.Connection, spans: Sequence[tuple[int, int, int]], worker_id: str
    ) -> str | None:
        """Why spans are not `worker_id`'s to name: a shard never leased to it. A lease now or
        before: a learner resumed after kill -9 (or sending a push again from its journal) names
        rows of a lease that lapsed while it was down (rows of a shard leased now to another
        worker are its holder's: `_held_by_other` cuts them out)."""
        for sid, a, b in spans:
            if not db.execute(
                "SELECT 1 FROM shard_holders WHERE shard_id = ? AND worker_id = ?", (sid, worker_id)
            ).fetchone():
                return f"span {sid}:[{a},{b}) is in a shard never leased to {worker_id}"
        return None

    def _held_by_other(self, db: sqlite3.Connection, sid: int, worker_id: str) -> bool:
        """Shard `sid` is leased now (a lease that has not lapsed) to a worker other than
        `worker_id`. Its untrained rows are what that lease handed out: they are its holder's,
        whoever held the shard before (a past holder that named them first would have the
        holder's push of its own rows refused as trained by someone else)."""
        return (
            db.execute(
                "SELECT 1 FROM shards WHERE id = ? AND state = 'leased' AND holder IS NOT NULL "
                "AND holder != ? AND lease_expires > ?",
                (sid, worker_id, self.clock()),
            ).fetchone()
            is not None
        )

    def _others_rows(
        self, db: sqlite3.Connection, worker_id: str, sid: int, exclude: str = ""
    ) -> list[leases.Range]:
        """Rows of shard `sid` in other workers' pending or merged pushes."""
        rows = db.execute(
            "SELECT s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id "
            "WHERE s.shard_id = ? AND p.worker_id != ? AND p.push_id != ? AND p.state IN ('pending', 'merged')",
            (sid, worker_id, exclude),
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def _fresh(
        self, db: sqlite3.Connection, worker_id: str, spans: Sequence[tuple[int, int, int]], exclude: str
    ) -> tuple[int, int, str, bool]:
        """The rows and tokens a push's spans hold that are its own: not in other workers'
        pushes, not in a shard leased now to another worker. With none, why (never
        PERMISSION_DENIED: the worker held those shards once)."""
        rows = toks = 0
        others_lease = False
        for sid, a, b in spans:
            if self._held_by_other(db, sid, worker_id):
                others_lease = True
                continue
            fresh = leases.subtract((a, b), self._others_rows(db, worker_id, sid, exclude))
            n = sum(y - x for x, y in fresh)
            rows, toks = rows + n, toks + self._span_tokens(db, [(sid, 0, n)])
        if not spans or rows:
            return rows, toks, "", False
        if others_lease:
            # INVALID_ARGUMENT, not PERMISSION_DENIED: an honest learner paused past its lease (its
            # shard leased on to another) sends such pushes too; refused, it trains on (a learner
            # takes PERMISSION_DENIED as its identity refused, and leaves).
            return 0, 0, "the rows this push names are in a shard leased now to another worker", False
        return 0, 0, "every row this push names is in other workers' pushes already", False

    def _held_todo(
        self, db: sqlite3.Connection, worker_id: str, spans: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[int, int]:
        """Rows and tokens of the train shards `worker_id` holds now that no push has named (nor
        `spans`, the push being claimed: its rows are counted as its own)."""
        rows = toks = 0
        for shard in db.execute(
            "SELECT id, rows, tokens FROM shards WHERE holder = ? AND state = 'leased' AND split = 'train'",
            (worker_id,),
        ).fetchall():
            named = db.execute(
                "SELECT s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id "
                "WHERE s.shard_id = ? AND p.state IN ('pending', 'merged')",
                (shard["id"],),
            ).fetchall()
            taken = [(r[0], r[1]) for r in named] + [(a, b) for sid, a, b in spans if sid == shard["id"]]
            todo = sum(y - x for x, y in leases.subtract((0, shard["rows"]), taken))
            rows, toks = rows + todo, toks + todo * (shard["tokens"] // max(1, shard["rows"]))
        return rows, toks

    def _credited(self, db: sqlite3.Connection, worker_id: str, fragment: int, exclude: str) -> int:
        """Tokens the worker's pushes of `fragment` (but `exclude`) were credited."""
        return int(
            db.execute(
                "SELECT COALESCE(SUM(tokens), 0) FROM pushes WHERE worker_id = ? AND fragment = ? "
                "AND push_id != ? AND state IN ('pending', 'merged')",
                (worker_id, fragment, exclude),
            ).fetchone()[0]
        )

    def _named(self, db: sqlite3.Connection, worker_id: str) -> tuple[int, int]:
        """Rows and tokens of every span the worker's pending and merged pushes named."""
        rows, toks = db.execute(
            "SELECT COALESCE(SUM(s.row_end - s.row_start), 0), "
            "COALESCE(SUM((s.row_end - s.row_start) * (sh.tokens / MAX(1, sh.rows))), 0) "
            "FROM spans s JOIN pushes p ON p.push_id = s.push_id JOIN shards sh ON sh.id = s.shard_id "
            "WHERE p.worker_id = ? AND p.state IN ('pending', 'merged')",
            (worker_id,),
        ).fetchone()
        return int(rows), int(toks)

    def _rowless_streak(self, db: sqlite3.Connection, worker_id: str, exclude: str, limit: int) -> int:
        """How many of the worker's latest pushes (any fragment, up to `limit`) named no rows,
        counted back to its last push that did."""
        recent = db.execute(
            "SELECT EXISTS(SELECT 1 FROM spans s WHERE s.push_id = p.push_id) FROM pushes p "
            "WHERE p.worker_id = ? AND p.push_id != ? AND p.state IN ('pending', 'merged') "
            "ORDER BY p.received DESC LIMIT ?",
            (worker_id, exclude, limit),
        ).fetchall()
        streak = 0
        for (has_rows,) in recent:
            if has_rows:
                break
            streak += 1
        return streak

    def _span_problem(self, db: sqlite3.Connection, spans: Sequence[tuple[int, int, int]]) -> str | None:
        """Why a push's spans are refused (overlapping each other, outside their shard, in a shard
        that is not a train shard or is corrupt), or None."""
        by_shard: dict[int, list[leases.Range]] = {}
        for sid, a, b in spans:
            by_shard.setdefault(sid, []).append((a, b))
        if any(leases.overlaps(ranges) for ranges in by_shard.values()):
            return "spans of this push overlap each other"
        for sid, a, b in spans:
            shard = db.execute("SELECT rows, split, state FROM shards WHERE id = ?", (sid,)).fetchone()
            if shard is None or not 0 <= a < b <= shard["rows"]:
                return f"span {sid}:[{a},{b}) is not inside a known shard"
            if shard["split"] != "train" or shard["state"] == "corrupt":
                return f"span {sid}:[{a},{b}) is in a {shard['state']} {shard['split']} shard: not trainable"
        return None

    def _span_tokens(self, db: sqlite3.Connection, spans: Sequence[tuple[int, int, int]]) -> int:
        total = 0
        for sid, a, b in spans:
            shard = db.execute("SELECT rows, tokens FROM shards WHERE id = ?", (sid,)).fetchone()
            if shard is not None and shard["rows"]:
                total += (b - a) * (shard["tokens"] // shard["rows"])
        return total

    def push_claim(
        self,
        worker_id: str,
        fragment: int,
        push_id: str,
        spans: Sequence[tuple[int, int, int]],
        steps: int,
        tokens: int,
        batch_size: int,
        fragments: int = 1,
        inner_steps: int = 0,
    ) -> Claim:
        """What a delta is credited with, checked before it is received: its spans must be the
        pusher's (leased to it now or before, not leased now to another worker, not all in other
        workers' pushes), and its steps and tokens are bounded by the rows behind it.

        A push with rows is backed by the fresh rows it names, P (`fragments`) times (every row
        moved every fragment), or by them and P − 1 intervals of `inner_steps` / P steps if more
        (rows its steps trained after its oldest interval, still waiting for their cover). A push
        with none by the untrained rows of the train shards its worker holds, and only as one of
        the first P − 1 pushes since the worker's last push with rows. Either way, the tokens
        credited to the worker's pushes of this fragment stay within the rows it named and holds
        (its budget): held rows credited to a push ahead of its rows are counted off when those
        rows are named. Steps are credited as the credited rows
        fill batches of `batch_size` rows (a step is batch_size rows on any number of ranks)."""
        with self._lock:
            db = self._db
            if problem := self._not_leased(db, spans, worker_id):
                return Claim(0, 0, problem, denied=True)
            if problem := self._span_problem(db, spans):
                return Claim(0, 0, problem)
            rows, toks, problem, denied = self._fresh(db, worker_id, spans, push_id)
            if problem:
                return Claim(0, 0, problem, denied=denied)
            held_rows, held_toks = self._held_todo(db, worker_id, spans)
            # The budget: the rows the worker named (each backs one push of every fragment) less
            # what its pushes of this fragment were credited; this push's own rows and the held
            # ones are added below.
            named_rows, named_toks = self._named(db, worker_id)
            unclaimed = named_toks - self._credited(db, worker_id, fragment, push_id)
            if spans:
                # A push of fragment p holds the steps since p's last push: the P intervals between
                # its worker's last P pushes. It names the rows of the oldest (the others' rows
                # wait for their cover, compute/rows.py), so it may be credited up to P − 1 more
                # intervals of H/P steps: a learner that pushed early to catch up after a resume
                # names fewer rows than its next push trained (measured: 14 steps' rows for 39).
                waiting_rows = (fragments - 1) * inner_steps * batch_size / fragments
                cap_rows = max(fragments * rows, rows + waiting_rows)
                cap_toks = math.floor(cap_rows * toks / rows)
            else:
                # Rows its worker named that this fragment's pushes were not credited for: a hand-in
                # names every row on its first push, and the other fragments' follow with none
                # (each row backs one push of every fragment). With no shard left to hold (the data
                # ran out) they were refused, and those fragments' last steps lost.
                owed_toks = max(0, unclaimed)
                owed_rows = owed_toks * named_rows / max(1, named_toks)
                if not held_toks and not owed_toks:
                    return Claim(0, 0, "a delta must name the rows it trained on (spans)")
                ahead = max(0, fragments - 1)
                if self._rowless_streak(db, worker_id, push_id, ahead + 1) >= ahead:
                    return Claim(
                        0, 0,
                        f"a delta names no rows (spans): at most {ahead} such pushes follow a push with "
                        "rows (or start a learner)",
                    )  # fmt: skip
                cap_rows, cap_toks = held_rows + owed_rows, held_toks + owed_toks
            budget = unclaimed + toks + held_toks
        toks_ok = min(tokens, cap_toks, budget)
        if toks_ok < 1 and spans:
            # Its rows are its own and untrained by anyone else, but what they back was credited
            # ahead to this fragment's earlier pushes (a learner resumed from a state older than
            # its last push trains some steps twice). Refused, its rows would be lost and trained
            # again, and refused again: they are recorded instead, and the delta merges nothing.
            return Claim(0, 0, rows_only=True)
        if toks_ok < 1:
            return Claim(0, 0, "no rows back this delta: the rows it holds are credited already")
        rows_ok = cap_rows * toks_ok / max(1, cap_toks)
        return Claim(min(steps, max(1, math.ceil(rows_ok / max(1, batch_size)))), toks_ok)
