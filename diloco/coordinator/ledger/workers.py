"""Workers: joins, heartbeats (with earlier lives' counts), lease renewal, leaving, expiry."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.coordinator import leases
from diloco.coordinator.ledger.db import LedgerBase, _bump


class WorkersTable(LedgerBase):
    def join(self, worker_id: str, role: str, host: str, caller: str | None = None) -> None:
        """The worker is active (again), in `role`; `caller`: who joined it (coordinator/callers.py
        decides who may, and when an id may change its role), kept so that a restarted coordinator
        still knows it. None keeps the one held."""
        now = self.clock()
        with self._tx() as db:
            db.execute(
                "INSERT INTO workers(id, role, host, joined, last_seen, state, caller) "
                "VALUES (?, ?, ?, ?, ?, 'active', ?) "
                "ON CONFLICT(id) DO UPDATE SET last_seen = excluded.last_seen, state = 'active', role = excluded.role, "
                "host = excluded.host, caller = COALESCE(excluded.caller, workers.caller)",
                (worker_id, role, host, now, now, caller),
            )

    def binding(self, worker_id: str, ttl_s: float = 0.0) -> tuple[str, str, bool] | None:
        """(role, caller, live) of a worker id, None when it never joined: the caller that joined
        it ("" before one was kept) and whether it is active and heard from within `ttl_s`."""
        rows = self._q("SELECT role, caller, state, last_seen FROM workers WHERE id = ?", (worker_id,))
        if not rows:
            return None
        r = rows[0]
        live = r["state"] == "active" and leases.is_live(r["last_seen"], self.clock(), ttl_s)
        return str(r["role"]), str(r["caller"] or ""), live

    def bind_caller(self, worker_id: str, caller: str) -> None:
        """`worker_id`'s caller, when it had none (a ledger from before they were kept)."""
        with self._tx() as db:
            db.execute("UPDATE workers SET caller = ? WHERE id = ? AND caller IS NULL", (caller, worker_id))

    def live_workers_of(self, caller: str, ttl_s: float) -> list[str]:
        """The live workers `caller` joined."""
        now = self.clock()
        rows = self._q("SELECT id, last_seen FROM workers WHERE caller = ? AND state = 'active'", (caller,))
        return [r["id"] for r in rows if leases.is_live(r["last_seen"], now, ttl_s)]

    def worker_role(self, worker_id: str) -> str | None:
        role = self._one("SELECT role FROM workers WHERE id = ?", (worker_id,))
        return None if role is None else str(role)

    def known_worker(self, worker_id: str) -> bool:
        return self._one("SELECT 1 FROM workers WHERE id = ? AND state = 'active'", (worker_id,)) is not None

    def heartbeat(self, worker_id: str, stats: dict[str, Any]) -> None:
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT stats FROM workers WHERE id = ?", (worker_id,)).fetchone()
            previous = json.loads(row["stats"]) if row else {}
            before = int(previous.get("tokens_trained", 0))
            if int(stats.get("tokens_trained", 0)) < before:
                # A restarted process under the same id counts from zero again: keep what its
                # previous life reported, so killed learners' work still shows as trained (and
                # its time in inner steps, for goodput).
                _bump(db, "tokens_trained_by_earlier_lives", before)
                _bump(db, "busy_seconds_by_earlier_lives", float(previous.get("busy_seconds", 0.0)))
                # Its kept time: as its last heartbeat told it, or as the new life's resumed state
                # saved it later (steps after the last heartbeat, merged all the same).
                kept = max(
                    float(previous.get("kept_busy_seconds", 0.0)),
                    float(stats.get("resumed_kept_busy_seconds", 0.0)),
                )
                _bump(db, "kept_busy_seconds_by_earlier_lives", kept)
            db.execute(
                "UPDATE workers SET last_seen = ?, stats = ? WHERE id = ?",
                (now, json.dumps(stats), worker_id),
            )

    def renew(
        self, worker_id: str, chunk_ids: Sequence[int], shard_ids: Sequence[int], ttl_s: float
    ) -> tuple[list[int], list[int]]:
        """Move the named leases' deadlines on; return those this worker no longer holds."""
        deadline = leases.lease_deadline(self.clock(), ttl_s)
        with self._tx() as db:
            lost_chunks = _renew(db, "chunks", chunk_ids, worker_id, deadline)
            lost_shards = _renew(db, "shards", shard_ids, worker_id, deadline)
        return lost_chunks, lost_shards

    def extend_deadlines(self, seconds: float) -> None:
        """Every live lease and every active worker's last heartbeat moved on by `seconds` (no later
        than now): the coordinator itself could not hear them for that long (stall.own_stall_s)."""
        now = self.clock()
        with self._tx() as db:
            for table in ("chunks", "shards"):
                db.execute(
                    f"UPDATE {table} SET lease_expires = lease_expires + ? WHERE state = 'leased'", (seconds,)
                )
            db.execute(
                "UPDATE workers SET last_seen = MIN(last_seen + ?, ?) WHERE state = 'active'", (seconds, now)
            )

    def leave(self, worker_id: str, state: str = "left") -> None:
        """The worker is gone: its leases go back to the pool at once."""
        with self._tx() as db:
            db.execute("UPDATE workers SET state = ? WHERE id = ?", (state, worker_id))
            db.execute(
                "UPDATE chunks SET state = 'pending', holder = NULL, lease_expires = NULL WHERE holder = ? AND state = 'leased'",
                (worker_id,),
            )
            db.execute(
                "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL WHERE holder = ? AND state = 'leased'",
                (worker_id,),
            )

    def forget_idle(self, gone_s: float, limit: int = 1000) -> int:
        """Delete up to `limit` workers gone (left or lost) for `gone_s` seconds that are named
        nowhere else: no lease ever held, no push, no evaluation, no report. Returns how many.

        Ids that only joined (fake learners, a misconfigured script in a loop) would otherwise stay
        for good: the new-id rate bound slows them to thousands a day per host, not to none. A
        worker named anywhere stays, since its history (rows held, pushes credited, bindings)
        holds its id; such workers grow with the run's real work, not with joins.
        """
        cutoff = self.clock() - gone_s
        with self._tx() as db:
            return db.execute(
                "DELETE FROM workers WHERE id IN (SELECT w.id FROM workers w "
                "WHERE w.state != 'active' AND w.last_seen <= ? "
                "AND NOT EXISTS (SELECT 1 FROM pushes p WHERE p.worker_id = w.id) "
                "AND NOT EXISTS (SELECT 1 FROM shard_holders h WHERE h.worker_id = w.id) "
                "AND NOT EXISTS (SELECT 1 FROM chunk_attempts a WHERE a.worker_id = w.id) "
                "AND NOT EXISTS (SELECT 1 FROM evals e WHERE e.worker_id = w.id) "
                "AND NOT EXISTS (SELECT 1 FROM shard_reports r WHERE r.worker_id = w.id) LIMIT ?)",
                (cutoff, limit),
            ).rowcount

    def live_workers(self, role: str | None, ttl_s: float) -> list[str]:
        """The live workers of a role (None: of every role)."""
        now = self.clock()
        rows = self._q(
            "SELECT id, last_seen FROM workers WHERE (role = ? OR ? IS NULL) AND state = 'active'",
            (role, role),
        )
        return [r["id"] for r in rows if leases.is_live(r["last_seen"], now, ttl_s)]

    def leases_held(self, worker_id: str) -> int:
        """Chunk and shard leases `worker_id` holds now."""
        return sum(
            self._one(f"SELECT COUNT(*) FROM {table} WHERE holder = ? AND state = 'leased'", (worker_id,))  # noqa: S608
            for table in ("chunks", "shards")
        )

    def live_worker_stats(self, role: str, ttl_s: float) -> dict[str, dict[str, Any]]:
        """The last heartbeat stats of every live worker of a role, by id (one query)."""
        now = self.clock()
        rows = self._q(
            "SELECT id, last_seen, stats FROM workers WHERE role = ? AND state = 'active'", (role,)
        )
        return {r["id"]: json.loads(r["stats"]) for r in rows if leases.is_live(r["last_seen"], now, ttl_s)}

    def workers(self) -> list[sqlite3.Row]:
        return self._read("SELECT * FROM workers ORDER BY joined")  # for reports: off the write lock

    def reclaim_expired(self, ttl_s: float, max_chunk_attempts: int = 0) -> Reclaimed:
        """Expired leases back to the pool; silent workers marked lost (and their leases freed).

        A chunk whose lease ran out max_chunk_attempts times (its workers died or hung on it: a
        poison chunk) is quarantined instead of handed out again.
        """
        now = self.clock()
        quarantined: list[int] = []
        with self._tx() as db:
            if max_chunk_attempts > 0:
                quarantined = _ids(db.execute(
                    "UPDATE chunks SET state = 'quarantined', holder = NULL, lease_expires = NULL, "
                    "error = 'lease expired ' || attempts || ' times: the worker died or hung on this chunk' "
                    "WHERE state = 'leased' AND lease_expires <= ? AND attempts >= ? RETURNING id",
                    (now, max_chunk_attempts),
                ))  # fmt: skip
            chunks = _ids(db.execute(
                "UPDATE chunks SET state = 'pending', holder = NULL, lease_expires = NULL "
                "WHERE state = 'leased' AND lease_expires <= ? RETURNING id",
                (now,),
            ))  # fmt: skip
            shards = _ids(db.execute(
                "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                "WHERE state = 'leased' AND lease_expires <= ? RETURNING id",
                (now,),
            ))  # fmt: skip
            lost = [(r[0], r[1]) for r in db.execute(
                "UPDATE workers SET state = 'lost' WHERE state = 'active' AND last_seen <= ? RETURNING id, role",
                (now - ttl_s,),
            )]  # fmt: skip
        return Reclaimed(chunks, shards, lost, quarantined)


@dataclass(frozen=True)
class Reclaimed:
    """What one pass of lease expiry took back: ids of chunks and shards back in the pool, workers
    found silent (id, role), and chunks quarantined for expiring too often."""

    chunks: list[int]
    shards: list[int]
    lost: list[tuple[str, str]]
    quarantined: list[int]


def _ids(rows: Iterable[sqlite3.Row | tuple]) -> list[int]:
    return [int(r[0]) for r in rows]


def _renew(
    db: sqlite3.Connection, table: str, ids: Sequence[int], worker_id: str, deadline: float
) -> list[int]:
    """Move the leases on `table`'s rows `ids` held by `worker_id` to `deadline`; the ids it no
    longer holds. (`table` is one of this module's own names, never input.)"""
    lost = []
    for row_id in ids:
        n = db.execute(
            f"UPDATE {table} SET lease_expires = ? WHERE id = ? AND holder = ? AND state = 'leased'",  # noqa: S608
            (deadline, row_id, worker_id),
        ).rowcount
        if not n:
            lost.append(row_id)
    return lost
