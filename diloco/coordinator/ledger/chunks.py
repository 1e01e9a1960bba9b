"""Raw chunks for data workers: leases (with the make-ahead bound), completions, failures."""

from __future__ import annotations

import sqlite3

from diloco.coordinator import leases
from diloco.coordinator.lease_claims import ChunkRow, Refusal, Verdict, completion_verdict
from diloco.coordinator.ledger.db import LedgerBase, _bump
from diloco.coordinator.ledger.records import ChunkLease, Completion, NoLease
from diloco.data.types import ChunkSpec


class ChunksTable(LedgerBase):
    def lease_chunk(
        self, worker_id: str, ttl_s: float, max_attempts: int = 0, max_ready: int = 0, slots: int = 0
    ) -> ChunkLease | NoLease:
        """A pending chunk, or "wait" (others hold the rest, or enough are made ahead), or "done".

        With `max_ready` > 0, a train chunk waits while that many train shards are made (or being
        made) and untouched by any learner; with dealing (`slots` > 0) that bound is per slot, so a
        slow learner's unread shards never hold back a fast one's. Eval chunks never wait (the
        final eval needs them)."""
        self.reclaim_expired(ttl_s, max_attempts)
        positions = self.train_positions()
        groups = max(1, slots)
        with self._tx() as db:
            ahead = self._made_ahead(db, positions, groups) if max_ready > 0 else [0] * groups
            cap = -(-max_ready // groups) if max_ready > 0 else 0
            row = None
            for candidate in db.execute(
                "SELECT id, spec, attempts, split FROM chunks WHERE state = 'pending' ORDER BY lease_order, id"
            ).fetchall():
                if (
                    candidate["split"] != "train"
                    or not cap
                    or ahead[positions[candidate["id"]] % groups] < cap
                ):
                    row = candidate
                    break
            if row is None:
                waiting = db.execute(
                    "SELECT COUNT(*) FROM chunks WHERE state IN ('leased', 'pending')"
                ).fetchone()[0]
                return NoLease.WAIT if waiting else NoLease.DONE
            db.execute(
                "UPDATE chunks SET state = 'leased', holder = ?, lease_expires = ?, attempts = attempts + 1 WHERE id = ?",
                (worker_id, leases.lease_deadline(self.clock(), ttl_s), row["id"]),
            )
            # Kept once the lease ends: only this worker completes this attempt (lease_claims).
            db.execute(
                "INSERT OR REPLACE INTO chunk_attempts(chunk_id, attempt, worker_id) VALUES (?, ?, ?)",
                (row["id"], row["attempts"] + 1, worker_id),
            )
            return ChunkLease(row["id"], ChunkSpec.from_json(row["spec"]), row["attempts"] + 1)

    @staticmethod
    def _made_ahead(db: sqlite3.Connection, positions: dict[int, int], groups: int) -> list[int]:
        """Per deal slot: train shards made (or being made) that no learner has trained a row of."""
        ahead = [0] * groups
        for (chunk_id,) in db.execute(
            "SELECT s.chunk_id FROM shards s WHERE s.split = 'train' AND s.state = 'ready' "
            "AND NOT EXISTS (SELECT 1 FROM spans p WHERE p.shard_id = s.id) "
            "UNION ALL SELECT id FROM chunks WHERE split = 'train' AND state = 'leased'"
        ).fetchall():
            ahead[positions[chunk_id] % groups] += 1
        return ahead

    def complete_chunk(
        self,
        worker_id: str,
        chunk_id: int,
        completion_id: str,
        uri: str,
        rows: int,
        tokens: int,
        checksum: str,
        nbytes: int,
        stats: dict[str, int],
        attempt: int | None = None,
    ) -> Completion:
        """Record the chunk's one shard, made by `worker_id` in attempt `attempt` of the chunk (None:
        its latest) into `uri`: taken from that attempt's lease holder only (lease_claims). A retry
        of a recorded completion is answered again."""
        with self._tx() as db:
            prior = self._prior_completion(db, completion_id, chunk_id)
            if prior is not None:
                return prior
            verdict = self._completion_verdict(db, worker_id, chunk_id, attempt, uri)
            if not verdict.taken:
                return Completion(False, verdict.reason)
            chunk = db.execute("SELECT split FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
            corrupt = db.execute(
                "SELECT id, rows FROM shards WHERE chunk_id = ? AND state = 'corrupt'", (chunk_id,)
            ).fetchone()
            if corrupt is not None:
                # Reprocessing is deterministic, so the repaired shard has the same rows and the
                # rows already merged from the old file stay counted: same shard id, new file.
                if corrupt["rows"] != rows:
                    return Completion(
                        False, f"repaired shard has {rows} rows, the original had {corrupt['rows']}"
                    )
                db.execute(
                    "UPDATE shards SET completion_id = ?, uri = ?, checksum = ?, nbytes = ?, state = 'ready', "
                    "holder = NULL, lease_expires = NULL WHERE id = ?",
                    (completion_id, uri, checksum, nbytes, corrupt["id"]),
                )
                db.execute(
                    "UPDATE chunks SET state = 'done', holder = NULL, lease_expires = NULL WHERE id = ?",
                    (chunk_id,),
                )
                _bump(db, "shards_repaired", 1)
                return Completion(True, "shard repaired", corrupt["id"])
            cur = db.execute(
                "INSERT INTO shards(chunk_id, completion_id, uri, split, rows, tokens, checksum, nbytes, state, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    chunk_id,
                    completion_id,
                    uri,
                    chunk["split"],
                    rows,
                    tokens,
                    checksum,
                    nbytes,
                    "ready" if rows else "consumed",
                    self.clock(),
                ),
            )
            db.execute(
                "UPDATE chunks SET state = 'done', holder = NULL, lease_expires = NULL, error = NULL WHERE id = ?",
                (chunk_id,),
            )
            for key, value in stats.items():
                _bump(db, f"records.{key}", value)
            return Completion(True, "recorded", int(cur.lastrowid))

    def completion_verdict(
        self, worker_id: str, chunk_id: int, completion_id: str, attempt: int | None, uri: str
    ) -> Verdict | None:
        """Whether `complete_chunk` would take this completion, asked before its file is read;
        None: a retry of a completion already recorded (complete_chunk answers it again)."""
        with self._tx() as db:
            if self._prior_completion(db, completion_id, chunk_id) is not None:
                return None
            return self._completion_verdict(db, worker_id, chunk_id, attempt, uri)

    @staticmethod
    def _prior_completion(db: sqlite3.Connection, completion_id: str, chunk_id: int) -> Completion | None:
        prior = db.execute(
            "SELECT id, chunk_id FROM shards WHERE completion_id = ?", (completion_id,)
        ).fetchone()
        if prior is None:
            return None
        return Completion(prior["chunk_id"] == chunk_id, "already recorded", prior["id"])

    @staticmethod
    def _completion_verdict(
        db: sqlite3.Connection, worker_id: str, chunk_id: int, attempt: int | None, uri: str
    ) -> Verdict:
        chunk = db.execute("SELECT state, holder, attempts FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
        if chunk is None:
            return Verdict(Refusal.DENIED, f"unknown chunk {chunk_id}")
        if attempt is None:  # (a caller that names no file: the worker's latest attempt)
            mine = db.execute(
                "SELECT MAX(attempt) FROM chunk_attempts WHERE chunk_id = ? AND worker_id = ?",
                (chunk_id, worker_id),
            ).fetchone()[0]
            attempt = chunk["attempts"] if mine is None else mine
        leased_to = db.execute(
            "SELECT worker_id FROM chunk_attempts WHERE chunk_id = ? AND attempt = ?", (chunk_id, attempt)
        ).fetchone()
        shard = db.execute("SELECT uri FROM shards WHERE chunk_id = ?", (chunk_id,)).fetchone()
        row = ChunkRow(
            chunk["state"],
            chunk["holder"],
            chunk["attempts"],
            leased_to[0] if leased_to else None,
            shard[0] if shard else None,
        )
        return completion_verdict(worker_id, chunk_id, attempt, uri, row)

    def fail_chunk(self, worker_id: str, chunk_id: int, error: str, max_attempts: int) -> bool:
        """Give a chunk back after a failure; quarantine it after max_attempts. True if quarantined."""
        with self._tx() as db:
            row = db.execute(
                "SELECT attempts, state, holder FROM chunks WHERE id = ?", (chunk_id,)
            ).fetchone()
            if row is None or row["state"] in ("done", "quarantined"):
                return row is not None and row["state"] == "quarantined"
            if row["holder"] != worker_id:  # a stale report: the chunk is someone else's now
                return False
            quarantine = row["attempts"] >= max_attempts
            db.execute(
                "UPDATE chunks SET state = ?, holder = NULL, lease_expires = NULL, error = ? WHERE id = ?",
                ("quarantined" if quarantine else "pending", error[:2000], chunk_id),
            )
            return quarantine
