"""Pushes and merges: each push's row spans, counted once, and the merges that count them."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from diloco.coordinator import leases
from diloco.coordinator.ledger.claims import ClaimsTable
from diloco.coordinator.ledger.db import DROPPED_BY_RESTART, _bump
from diloco.coordinator.ledger.records import MergeRecord


class PushRecorded(Exception):
    """record_push of a push_id the ledger holds already (and not as dropped by a restart): two
    copies of one push arrived together, and the other was recorded first. Answer it as a retry."""


class PushesTable(ClaimsTable):
    def push_state(self, push_id: str) -> sqlite3.Row | None:
        rows = self._q("SELECT * FROM pushes WHERE push_id = ?", (push_id,))
        return rows[0] if rows else None

    def record_push(
        self,
        push_id: str,
        worker_id: str,
        fragment: int,
        base_version: int,
        steps: int,
        tokens: int,
        spans: Sequence[tuple[int, int, int]],
        released: Sequence[int],
        state: str = "pending",
        reason: str = "",
        norm: float | None = None,
        watched: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None),
    ) -> str | None:
        """Record a received push with the shard rows it trained on. Returns a refusal reason or None.

        Spans must lie inside their shard and not overlap each other (else the push is malformed
        and refused, and only its `released` shards change: nothing of it is recorded). Rows
        already merged or pending for someone else (a learner that lost its lease, then came
        back) are cut out of the spans: the delta still merges, but those rows are counted once,
        by whoever had them first. That is the guard against counting twice. Rows of the same
        worker's own pending or merged push make it re-sent work (`_resent`): recorded as
        dropped, and refused. Raises PushRecorded when `push_id` is recorded already.

        Spans must lie in train shards that are not corrupt. Whose rows they are (leased to this
        worker now or before, not leased now to another, not all in other workers' pushes)
        push_claim checked before the delta streamed; rows of a shard leased to another worker
        since are cut out here, as rows trained twice are. `steps` and `tokens` are what push_claim
        credited; `norm` (per H steps) is kept for the outlier check's history across restarts,
        `watched` (its norm ratio, alignment and reported loss, refused or not) for its learner's
        watch, and (taken) its deviation from the mean step for the centered clip's history.
        """
        resent = None
        with self._tx() as db:
            # Checked in this transaction, not by the caller before it: a retry that arrives while
            # the first copy still streams has read "not recorded" too.
            prior = db.execute("SELECT state, reason FROM pushes WHERE push_id = ?", (push_id,)).fetchone()
            # A push the last coordinator dropped with its open round is taken afresh: it never
            # merged, and its rows are checked again below like any new push's.
            revived = prior is not None and tuple(prior) == ("dropped", DROPPED_BY_RESTART)
            if prior is not None and not revived:
                raise PushRecorded(push_id)
            if state == "pending" and (problem := self._span_problem(db, spans)):
                # Refused before anything is changed (a revived push keeps its dropped row). Its
                # released shards still go back: the learner has let them go whatever the answer,
                # and held they would wait out their lease for nobody.
                self._release(db, worker_id, released)
                return problem
            if revived:  # its first recording's counts are undone: they are made again below
                old = db.execute(
                    "SELECT shard_id, row_start, row_end FROM spans WHERE push_id = ?", (push_id,)
                ).fetchall()
                _bump(db, "tokens_trained", -self._span_tokens(db, [tuple(r) for r in old]))
                _bump(db, "pushes_received", -1)
                _bump(db, "pushes_revived", 1)
                db.execute("DELETE FROM spans WHERE push_id = ?", (push_id,))
                db.execute("DELETE FROM pushes WHERE push_id = ?", (push_id,))
            if state == "pending":
                resent = None if revived else self._resent(db, worker_id, spans)
                if resent is not None:
                    state, reason = "dropped", resent
                    spans = []
                kept: list[tuple[int, int, int]] = []
                for sid, a, b in spans:
                    # A shard leased to another worker since push_claim read it: its rows are
                    # its holder's (counted by its push), this push merges without them.
                    taken = [(0, b)] if self._held_by_other(db, sid, worker_id) else []
                    fresh = leases.subtract((a, b), taken + self._spans(db, sid, ("merged", "pending")))
                    kept.extend((sid, x, y) for x, y in fresh)
                    _bump(db, "rows_trained_twice", (b - a) - sum(y - x for x, y in fresh))
                spans = kept
            db.execute(
                "INSERT INTO pushes(push_id, worker_id, fragment, base_version, steps, tokens, state, reason, "
                "received, norm, ratio, alignment, deviation, loss) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    push_id,
                    worker_id,
                    fragment,
                    base_version,
                    steps,
                    tokens,
                    state,
                    reason or None,
                    self.clock(),
                    norm if state == "pending" else None,
                    *watched[:2],
                    watched[2] if state == "pending" else None,
                    watched[3],
                ),
            )
            if state == "pending":
                db.executemany(
                    "INSERT INTO spans(shard_id, row_start, row_end, push_id) VALUES (?, ?, ?, ?)",
                    [(sid, a, b, push_id) for sid, a, b in spans],
                )
            self._release(db, worker_id, released)
            # Trained tokens are counted from the rows the push names, not from its `tokens`
            # field: with several fragments every fragment's push reports the same tokens.
            _bump(db, "tokens_trained", self._span_tokens(db, spans))
            _bump(db, "pushes_refused" if state == "dropped" else "pushes_received", 1)
        return resent

    def recent_norms(self, fragment: int, limit: int, min_steps: int = 0) -> list[tuple[str, float, float]]:
        """The last `limit` merged pushes of `fragment` with a norm and at least `min_steps`
        steps, oldest first: (worker, norm per H steps, deviation per H steps), the outlier
        check's and the centered clip's history after a restart (a push from before deviations
        were kept: its norm, its deviation from a zero momentum)."""
        rows = self._q(
            "SELECT worker_id, norm, deviation FROM pushes WHERE fragment = ? AND state = 'merged' AND norm IS NOT NULL "
            "AND steps >= ? ORDER BY merged_version DESC, received DESC LIMIT ?",
            (fragment, min_steps, limit),
        )
        return [(str(r[0]), float(r[1]), float(r[1] if r[2] is None else r[2])) for r in reversed(rows)]

    def first_loss(self) -> float | None:
        """The mean training loss of the run's first merged round with one (the scale the pusher
        watch measures a learner's loss against), or None before it."""
        value = self._one("SELECT mean_loss FROM rounds WHERE mean_loss > 0 ORDER BY closed LIMIT 1")
        return float(value) if value is not None else None

    def last_refused_as(self, prefix: str) -> dict[str, str]:
        """The joined learners whose last push was refused with a reason starting `prefix` (the
        pusher watch's refusal: named when the coordinator stopped), each with that reason."""
        rows = self._q(  # each learner's last push: one step down pushes_by_worker
            "SELECT w.id, (SELECT reason FROM pushes WHERE worker_id = w.id ORDER BY received DESC "
            "LIMIT 1) FROM workers w WHERE w.role = 'compute' AND w.state = 'active'"
        )
        return {str(r[0]): str(r[1]) for r in rows if (r[1] or "").startswith(prefix)}

    def recent_watched(
        self, limit: int
    ) -> dict[str, list[tuple[float, float | None, float | None, int, float | None]]]:
        """Each joined learner's last `limit` pushes of each fragment the pusher watch saw, oldest
        first: (when received, norm ratio, alignment, fragment, reported loss), its watch after a
        restart."""
        learners = [
            r[0] for r in self._q("SELECT id FROM workers WHERE role = 'compute' AND state = 'active'")
        ]
        out: dict[str, list[tuple[float, float | None, float | None, int, float | None]]] = {}
        for worker_id in learners:
            rows = self._q(
                "SELECT received, ratio, alignment, fragment, loss FROM (SELECT received, ratio, "
                "alignment, fragment, loss, ROW_NUMBER() OVER (PARTITION BY fragment ORDER BY received "
                "DESC) AS n FROM pushes WHERE worker_id = ? AND (ratio IS NOT NULL OR alignment IS NOT "
                "NULL OR loss IS NOT NULL)) "
                "WHERE n <= ? ORDER BY received",
                (worker_id, limit),
            )
            if rows:
                out[str(worker_id)] = [(float(r[0]), r[1], r[2], int(r[3]), r[4]) for r in rows]
        return out

    def _release(self, db: sqlite3.Connection, worker_id: str, released: Sequence[int]) -> None:
        """The shards the push says its learner holds no more: back to the pool (its own leases only)."""
        for sid in released:
            db.execute(
                "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                "WHERE id = ? AND holder = ? AND state = 'leased'",
                (sid, worker_id),
            )

    def _resent(
        self, db: sqlite3.Connection, worker_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> str | None:
        """Why this push is work the worker already sent, or None.

        One life of a learner carries each row on one push only, and a fresh life leases only
        rows nobody holds; so rows of its own pending or merged push come back only from a life
        resumed from a state older than its last push. Its delta holds that push's steps again,
        and merging it would apply them twice (a push the coordinator's restart dropped and the
        learner sends again is not this: it is taken afresh, `revived` above)."""
        for sid, a, b in spans:
            hit = db.execute(
                "SELECT p.push_id, p.state, s.row_start, s.row_end FROM spans s "
                "JOIN pushes p ON p.push_id = s.push_id WHERE s.shard_id = ? AND p.worker_id = ? "
                "AND p.state IN ('pending', 'merged') AND s.row_start < ? AND s.row_end > ? LIMIT 1",
                (sid, worker_id, b, a),
            ).fetchone()
            if hit is not None:
                return (
                    f"re-sent work: rows {sid}:[{max(a, hit[2])},{min(b, hit[3])}) are in this "
                    f"worker's {hit[1]} push {hit[0]} already"
                )
        return None

    def commit_merges(self, fragment: int, merges: Sequence[MergeRecord]) -> None:
        """One transaction: the rounds, their pushes merged, their shards' rows counted, version on.

        Several merges of one fragment may share a transaction (and one checkpoint file, that of
        the last): the coordinator publishes merges in groups when merging outpaces the store.
        """
        if not merges:
            return
        by_worker: dict[str, int] = {}
        with self._tx() as db:
            for merge in merges:
                self._commit_one_merge(db, fragment, merge, by_worker)
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                (f"fragment_version.{fragment}", str(merges[-1].version)),
            )
        self._count_merged_by_worker(by_worker)

    def _count_merged_by_worker(self, by_worker: dict[str, int]) -> None:
        with self._lock:  # once committed
            for worker_id, tokens in by_worker.items():
                self._merged_by_worker[worker_id] = self._merged_by_worker.get(worker_id, 0) + tokens

    def _commit_one_merge(
        self, db: sqlite3.Connection, fragment: int, merge: MergeRecord, by_worker: dict[str, int]
    ) -> None:
        self._mark_merged(db, merge.push_ids, merge.version, by_worker)
        db.execute(
            "INSERT INTO rounds(fragment, version, closed, pushes, tokens, steps, mean_loss, reason, scale) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                fragment,
                merge.version,
                self.clock(),
                len(merge.push_ids),
                merge.tokens,
                merge.steps,
                merge.mean_loss,
                merge.reason,
                merge.scale,
            ),
        )
        _bump(db, "rounds", 1)

    def _mark_merged(
        self, db: sqlite3.Connection, push_ids: Sequence[str], version: int, by_worker: dict[str, int]
    ) -> None:
        """Pending pushes merged at `version`: their rows counted merged (by worker, into
        `by_worker`), and each shard whose rows are all merged now consumed."""
        marks = ",".join("?" * len(push_ids))
        db.execute(
            f"UPDATE pushes SET state = 'merged', merged_version = ? WHERE state = 'pending' AND push_id IN ({marks})",
            (version, *push_ids),
        )
        shard_ids = [
            r[0]
            for r in db.execute(
                f"SELECT DISTINCT shard_id FROM spans WHERE push_id IN ({marks})", tuple(push_ids)
            )
        ]
        merged_tokens = 0
        for sid in shard_ids:
            shard = db.execute("SELECT rows, tokens FROM shards WHERE id = ?", (sid,)).fetchone()
            per_row = shard["tokens"] // max(1, shard["rows"])
            for a, b, worker_id in db.execute(
                "SELECT s.row_start, s.row_end, p.worker_id FROM spans s JOIN pushes p USING (push_id) "
                f"WHERE s.shard_id = ? AND s.push_id IN ({marks})",
                (sid, *push_ids),
            ).fetchall():
                merged_tokens += (b - a) * per_row
                by_worker[worker_id] = by_worker.get(worker_id, 0) + (b - a) * per_row
            if leases.covered_rows(self._spans(db, sid, ("merged",))) >= shard["rows"]:
                db.execute(
                    "UPDATE shards SET state = 'consumed', holder = NULL, lease_expires = NULL WHERE id = ?",
                    (sid,),
                )
        _bump(db, "tokens_merged", merged_tokens)

    def record_rows_only(
        self,
        push_id: str,
        worker_id: str,
        fragment: int,
        base_version: int,
        spans: Sequence[tuple[int, int, int]],
        released: Sequence[int],
        version: int,
    ) -> str | None:
        """A push taken for its rows only (push_claim's `rows_only`: its own fresh rows, with no
        credit left for them): recorded with no steps or tokens and merged at once, at the
        fragment's current `version`, with no round of its own. Its rows count as trained and
        merged (their training was credited to the worker's earlier pushes), so they are never
        leased again; its delta merges nothing. The refusal of record_push, or None."""
        reason = "rows only: no credit left for this delta"
        refusal = self.record_push(
            push_id, worker_id, fragment, base_version, 0, 0, spans, released, reason=reason
        )
        if refusal is not None:
            return refusal
        by_worker: dict[str, int] = {}
        with self._tx() as db:
            self._mark_merged(db, [push_id], version, by_worker)
            _bump(db, "pushes_rows_only", 1)
        self._count_merged_by_worker(by_worker)
        return None

    def drop_pushes(self, push_ids: Sequence[str], reason: str) -> None:
        """Pushes that will never merge: their rows become trainable again."""
        with self._tx() as db:
            for pid in push_ids:
                db.execute(
                    "UPDATE pushes SET state = 'dropped', reason = ? WHERE push_id = ? AND state = 'pending'",
                    (reason, pid),
                )

    def round_pushers(self, fragment: int, version: int) -> tuple[float, frozenset[str]] | None:
        """The merged round that made `version`: when its first push arrived, and who pushed."""
        rows = self._q(
            "SELECT worker_id, received FROM pushes WHERE fragment = ? AND merged_version = ? "
            "AND state = 'merged' AND tokens > 0",
            (fragment, version),
        )
        if not rows:
            return None
        return min(r["received"] for r in rows), frozenset(r["worker_id"] for r in rows)

    def fragment_version(self, fragment: int) -> int:
        return int(self.get_meta(f"fragment_version.{fragment}", "0") or 0)
