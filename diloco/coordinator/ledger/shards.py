"""Shards for learners: dealt leases of rows nobody has trained on, corruption, release."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Sequence

from diloco.coordinator import deal, leases
from diloco.coordinator.lease_claims import SHARD_REPORT_WINDOW_S, Refusal, ShardRow, Verdict, report_verdict
from diloco.coordinator.ledger.db import LedgerBase, _bump
from diloco.coordinator.ledger.records import NoLease, ShardLease


class ShardsTable(LedgerBase):
    def _spans(self, db: sqlite3.Connection, shard_id: int, states: Sequence[str]) -> list[leases.Range]:
        marks = ",".join("?" * len(states))
        rows = db.execute(
            f"SELECT s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id "
            f"WHERE s.shard_id = ? AND p.state IN ({marks})",
            (shard_id, *states),
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def _todo(self, db: sqlite3.Connection, shard_id: int, rows: int) -> list[leases.Range]:
        return leases.subtract((0, rows), self._spans(db, shard_id, ("merged", "pending")))

    def train_positions(self) -> dict[int, int]:
        """chunk id -> its place among the train chunks in lease order (what `deal` deals by).
        Chunks never change split or order, so this is read once."""
        if not self._positions:  # (empty until the ledger is initialized)
            rows = self._q("SELECT id FROM chunks WHERE split = 'train' ORDER BY lease_order, id")
            self._positions = {r["id"]: i for i, r in enumerate(rows)}
        return self._positions

    def lease_shard(
        self,
        worker_id: str,
        ttl_s: float,
        slot: int | None = None,
        slots: int = 0,
        vacant: Collection[int] = (),
    ) -> ShardLease | NoLease:
        """A train shard with rows nobody has trained on, or why there is none (NoLease).

        With `slots` > 0 the shard is dealt to the learner's `slot` (deal.choose_shard); otherwise
        the first in lease order."""
        self.reclaim_expired(ttl_s)
        positions = self.train_positions()
        with self._tx() as db:
            ready = db.execute(
                "SELECT id, chunk_id, uri, checksum, rows FROM shards WHERE split = 'train' AND state = 'ready'"
            ).fetchall()
            by_id = {row["id"]: row for row in ready}
            candidates = [deal.Candidate(row["id"], positions[row["chunk_id"]]) for row in ready]
            own_unmade = []  # (position, state) of this slot's train chunks not made yet
            holding = 0  # train shards this learner has open: it leaves other slots' alone
            if slots > 0 and slot is not None:  # only a dealt lease needs them
                holding = db.execute(
                    "SELECT COUNT(*) FROM shards WHERE split = 'train' AND state = 'leased' AND holder = ?",
                    (worker_id,),
                ).fetchone()[0]
                unmade = db.execute(
                    "SELECT id, state FROM chunks WHERE split = 'train' AND state IN ('pending', 'leased')"
                ).fetchall()
                own_unmade = [
                    (positions[r["id"]], r["state"]) for r in unmade if positions[r["id"]] % slots == slot
                ]
            own_work_coming = bool(own_unmade)
            # Only a chunk a data worker holds is waited for in order: a pending one (its attempt
            # failed) may wait behind the slot's bound on ready shards, and must not hold it up.
            own_being_made = min((pos for pos, state in own_unmade if state == "leased"), default=None)
            while True:
                choice = deal.choose_shard(
                    candidates, slot, slots, vacant, own_work_coming, own_being_made, holding
                )
                if choice.shard_id is None:
                    if own_work_coming:
                        return NoLease.WAIT_DEALT
                    break
                row = by_id[choice.shard_id]
                todo = self._todo(db, row["id"], row["rows"])
                if not todo:  # every row is merged or in a pending push: not a candidate
                    candidates = [c for c in candidates if c.shard_id != row["id"]]
                    continue
                db.execute(
                    "UPDATE shards SET state = 'leased', holder = ?, lease_expires = ? WHERE id = ?",
                    (worker_id, leases.lease_deadline(self.clock(), ttl_s), row["id"]),
                )
                # Kept once the lease ends (a learner gives a shard back, then reports it): who
                # may report it corrupt.
                db.execute(
                    "INSERT OR REPLACE INTO shard_last_holder(shard_id, worker_id) VALUES (?, ?)",
                    (row["id"], worker_id),
                )
                position = positions[row["chunk_id"]]
                return ShardLease(
                    row["id"], row["uri"], row["checksum"], row["rows"], todo, slot, position, choice.reason
                )
            unfinished_chunks = db.execute(
                "SELECT COUNT(*) FROM chunks WHERE split = 'train' AND state IN ('pending', 'leased')"
            ).fetchone()[0]
            # A corrupt shard is not open: its chunk is made again (pending above) or quarantined.
            open_shards = db.execute(
                "SELECT COUNT(*) FROM shards WHERE split = 'train' AND state IN ('ready', 'leased')"
            ).fetchone()[0]
            return NoLease.WAIT if unfinished_chunks or open_shards else NoLease.DONE

    def train_data_exhausted(self) -> bool:
        """lease_shard's DONE, asked without leasing: no train chunk is pending or leased, and no
        train shard is ready or leased (each consumed, its rows merged, or corrupt with its chunk quarantined).
        No train chunk at all is not exhausted: the data never came. Equality on (split, state):
        the index answers, however many shards."""
        return bool(
            self._one(
                "SELECT EXISTS(SELECT 1 FROM chunks WHERE split = 'train') "
                "AND NOT EXISTS(SELECT 1 FROM chunks WHERE split = 'train' AND state IN ('pending', 'leased')) "
                "AND NOT EXISTS(SELECT 1 FROM shards WHERE split = 'train' AND state IN ('ready', 'leased'))"
            )
        )

    def report_shard(self, worker_id: str, shard_id: int, error: str) -> Verdict:
        """`worker_id`'s report that a shard failed its checksum: taken (the shard out of play, its
        raw chunk made again) only from the learner that leased the train shard last, a few an
        hour (lease_claims.report_verdict); otherwise nothing changes."""
        now = self.clock()
        with self._tx() as db:
            shard = db.execute(
                "SELECT chunk_id, split, state, holder FROM shards WHERE id = ?", (shard_id,)
            ).fetchone()
            if shard is None:
                return Verdict(Refusal.DENIED, f"unknown shard {shard_id}")
            last = db.execute(
                "SELECT worker_id FROM shard_last_holder WHERE shard_id = ?", (shard_id,)
            ).fetchone()
            # shard_holders: every learner the shard was ever leased to (kept for pushes' spans).
            held = db.execute(
                "SELECT 1 FROM shard_holders WHERE shard_id = ? AND worker_id = ?", (shard_id, worker_id)
            ).fetchone()
            recent = db.execute(
                "SELECT COUNT(*) FROM shard_reports WHERE worker_id = ? AND at > ?",
                (worker_id, now - SHARD_REPORT_WINDOW_S),
            ).fetchone()[0]
            row = ShardRow(
                shard["split"],
                shard["state"],
                shard["holder"],
                last[0] if last else None,
                held is not None,
                recent,
            )
            verdict = report_verdict(worker_id, shard_id, row)
            if verdict.taken:
                db.execute(
                    "INSERT INTO shard_reports(worker_id, shard_id, at) VALUES (?, ?, ?)",
                    (worker_id, shard_id, now),
                )
                _mark_corrupt(db, shard_id, shard["chunk_id"], error)
            return verdict

    def report_corrupt_shard(self, shard_id: int, error: str) -> bool:
        """A shard that failed its checksum, whoever says so (the ledger's own tools and tests; a
        learner's report goes through `report_shard`): out of play, its raw chunk made again."""
        with self._tx() as db:
            shard = db.execute("SELECT chunk_id, state FROM shards WHERE id = ?", (shard_id,)).fetchone()
            if shard is None or shard["state"] in ("corrupt", "consumed"):
                return False
            _mark_corrupt(db, shard_id, shard["chunk_id"], error)
            return True

    def release_shards(self, worker_id: str, shard_ids: Iterable[int]) -> None:
        with self._tx() as db:
            for sid in shard_ids:
                db.execute(
                    "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                    "WHERE id = ? AND holder = ? AND state = 'leased'",
                    (sid, worker_id),
                )


def _mark_corrupt(db: sqlite3.Connection, shard_id: int, chunk_id: int, error: str) -> None:
    """A shard out of play and its raw chunk back in the pool, to be made again (same shard row)."""
    db.execute(
        "UPDATE shards SET state = 'corrupt', holder = NULL, lease_expires = NULL WHERE id = ?", (shard_id,)
    )
    db.execute(
        "UPDATE chunks SET state = 'pending', holder = NULL, lease_expires = NULL, error = ? WHERE id = ?",
        (f"shard {shard_id} corrupt: {error}"[:2000], chunk_id),
    )
    _bump(db, "shards_corrupt", 1)
