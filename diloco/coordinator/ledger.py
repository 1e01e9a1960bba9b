"""The coordinator's durable state: chunks, shards, leases, workers, pushes, rounds.

One SQLite file in WAL mode. Every method that changes state runs in one transaction and returns
after the commit, so an RPC that answers has its effect on disk. Time comes from an injected clock
so lease expiry is tested with a fake one. Tensors never live here (see checkpoint.py).

Data accounting: a shard's rows count as trained only through *merged* spans. A span is recorded
with its push (state pending); the merge flips the push to merged in the same transaction that
records the round, so a dropped push or a dead learner leaves its rows untrained and leasable.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.coordinator import deal, leases
from diloco.data.types import ChunkSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
  id INTEGER PRIMARY KEY, spec TEXT NOT NULL, split TEXT NOT NULL, nbytes INTEGER NOT NULL,
  state TEXT NOT NULL DEFAULT 'pending',          -- pending | leased | done | quarantined
  holder TEXT, lease_expires REAL, attempts INTEGER NOT NULL DEFAULT 0, error TEXT,
  lease_order INTEGER NOT NULL DEFAULT 0          -- chunks (and their shards) are handed out in this order
);
CREATE TABLE IF NOT EXISTS shards (
  id INTEGER PRIMARY KEY AUTOINCREMENT, chunk_id INTEGER NOT NULL UNIQUE REFERENCES chunks(id),
  completion_id TEXT NOT NULL UNIQUE, uri TEXT NOT NULL, split TEXT NOT NULL,
  rows INTEGER NOT NULL, tokens INTEGER NOT NULL, checksum TEXT NOT NULL, nbytes INTEGER NOT NULL,
  state TEXT NOT NULL DEFAULT 'ready',            -- ready | leased | consumed | corrupt
  holder TEXT, lease_expires REAL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
  id TEXT PRIMARY KEY, role TEXT NOT NULL, host TEXT NOT NULL, joined REAL NOT NULL,
  last_seen REAL NOT NULL, state TEXT NOT NULL, stats TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS pushes (
  push_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, fragment INTEGER NOT NULL,
  base_version INTEGER NOT NULL, steps INTEGER NOT NULL, tokens INTEGER NOT NULL,
  state TEXT NOT NULL,                            -- pending | merged | dropped
  merged_version INTEGER, reason TEXT, received REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS spans (
  shard_id INTEGER NOT NULL REFERENCES shards(id), row_start INTEGER NOT NULL,
  row_end INTEGER NOT NULL, push_id TEXT NOT NULL REFERENCES pushes(push_id)
);
CREATE INDEX IF NOT EXISTS spans_by_shard ON spans(shard_id);
CREATE INDEX IF NOT EXISTS spans_by_push ON spans(push_id);
CREATE TABLE IF NOT EXISTS rounds (
  fragment INTEGER NOT NULL, version INTEGER NOT NULL, closed REAL NOT NULL,
  pushes INTEGER NOT NULL, tokens INTEGER NOT NULL, steps INTEGER NOT NULL,
  mean_loss REAL, reason TEXT, scale REAL NOT NULL DEFAULT 1.0, PRIMARY KEY (fragment, version)
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL);
"""


@dataclass(frozen=True)
class ChunkLease:
    chunk_id: int
    spec: ChunkSpec
    attempt: int


@dataclass(frozen=True)
class ShardLease:
    shard_id: int
    uri: str
    checksum: str
    rows: int
    todo: list[leases.Range]
    slot: int | None = None  # the deal slot it was dealt from (None: first come)


@dataclass(frozen=True)
class Completion:
    accepted: bool
    reason: str
    shard_id: int = 0


@dataclass(frozen=True)
class MergeRecord:
    """One merge of a fragment: the pushes it holds and what they brought."""

    version: int
    push_ids: tuple[str, ...]
    tokens: int
    steps: int
    mean_loss: float | None
    reason: str
    scale: float = 1.0


def ledger_path(workdir: str | Path) -> Path:
    """The one place a run's ledger lives: <workdir>/state/ledger.sqlite."""
    return Path(workdir) / "state" / "ledger.sqlite"


class Ledger:
    def __init__(self, path: str, clock: Callable[[], float] = time.time):
        self.path = path
        self.clock = clock
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._positions: dict[int, int] | None = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        rows = self._q(sql, args)
        return rows[0][0] if rows else None

    # -- meta -----------------------------------------------------------------------------------

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        value = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return default if value is None else value

    def set_meta(self, **values: str) -> None:
        with self._tx() as db:
            for key, value in values.items():
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    @property
    def initialized(self) -> bool:
        return self.get_meta("dataset") is not None

    def initialize(
        self,
        chunks: Iterable[ChunkSpec],
        counters: dict[str, float] | None = None,
        shuffle_seed: int | None = None,
        **meta: str,
    ) -> None:
        """Record the dataset's chunks once (and starting counters); a restart keeps what is there.

        With a shuffle seed, chunks and their shards are handed out in a seeded random order, not
        in the dataset's (sorted) order: otherwise training walks the corpus file by file, and
        whatever the run happens to end on (say, a directory of lookup tables) shapes the model.
        """
        chunks = list(chunks)
        order = list(range(len(chunks)))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM meta WHERE key = 'dataset'").fetchone():
                return
            for c, position in zip(chunks, order, strict=True):
                db.execute(
                    "INSERT INTO chunks(id, spec, split, nbytes, lease_order) VALUES (?, ?, ?, ?, ?)",
                    (c.index + 1, c.to_json(), c.split, c.nbytes, position),
                )
            for name, value in (counters or {}).items():
                _bump(db, name, value)
            for key, value in meta.items():
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def run_id(self) -> str:
        """The run's identity: made on first use and kept for the ledger's life (restarts too)."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('run_id', ?)", (uuid.uuid4().hex,))
            return str(db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0])

    def next_epoch(self) -> int:
        """A new coordinator epoch: pushes that were in flight in the last one are gone."""
        with self._tx() as db:
            epoch = (
                int(
                    db.execute("SELECT COALESCE((SELECT value FROM meta WHERE key='epoch'), 0)").fetchone()[0]
                )
                + 1
            )
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('epoch', ?)", (str(epoch),))
            db.execute(
                "UPDATE pushes SET state = 'dropped', reason = 'coordinator restarted before merge' WHERE state = 'pending'"
            )
        return epoch

    # -- workers --------------------------------------------------------------------------------

    def join(self, worker_id: str, role: str, host: str) -> None:
        now = self.clock()
        with self._tx() as db:
            db.execute(
                "INSERT INTO workers(id, role, host, joined, last_seen, state) VALUES (?, ?, ?, ?, ?, 'active') "
                "ON CONFLICT(id) DO UPDATE SET last_seen = excluded.last_seen, state = 'active', host = excluded.host",
                (worker_id, role, host, now, now),
            )

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
                _bump(db, "kept_busy_seconds_by_earlier_lives", float(previous.get("kept_busy_seconds", 0.0)))
            db.execute(
                "UPDATE workers SET last_seen = ?, stats = ? WHERE id = ?",
                (now, json.dumps(stats), worker_id),
            )

    def renew(
        self, worker_id: str, chunk_ids: Sequence[int], shard_ids: Sequence[int], ttl_s: float
    ) -> tuple[list[int], list[int]]:
        """Move the named leases' deadlines on; return those this worker no longer holds."""
        deadline = leases.lease_deadline(self.clock(), ttl_s)
        lost_chunks: list[int] = []
        lost_shards: list[int] = []
        with self._tx() as db:
            for cid in chunk_ids:
                n = db.execute(
                    "UPDATE chunks SET lease_expires = ? WHERE id = ? AND holder = ? AND state = 'leased'",
                    (deadline, cid, worker_id),
                ).rowcount
                if not n:
                    lost_chunks.append(cid)
            for sid in shard_ids:
                n = db.execute(
                    "UPDATE shards SET lease_expires = ? WHERE id = ? AND holder = ? AND state = 'leased'",
                    (deadline, sid, worker_id),
                ).rowcount
                if not n:
                    lost_shards.append(sid)
        return lost_chunks, lost_shards

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

    def live_workers(self, role: str, ttl_s: float) -> list[str]:
        now = self.clock()
        rows = self._q("SELECT id, last_seen FROM workers WHERE role = ? AND state = 'active'", (role,))
        return [r["id"] for r in rows if leases.is_live(r["last_seen"], now, ttl_s)]

    def workers(self) -> list[sqlite3.Row]:
        return self._q("SELECT * FROM workers ORDER BY joined")

    def reclaim_expired(self, ttl_s: float, max_chunk_attempts: int = 0) -> dict[str, int]:
        """Expired leases back to the pool; silent workers marked lost (and their leases freed).

        A chunk whose lease ran out max_chunk_attempts times (its workers died or hung on it: a
        poison chunk) is quarantined instead of handed out again.
        """
        now = self.clock()
        with self._tx() as db:
            if max_chunk_attempts > 0:
                db.execute(
                    "UPDATE chunks SET state = 'quarantined', holder = NULL, lease_expires = NULL, "
                    "error = 'lease expired ' || attempts || ' times: the worker died or hung on this chunk' "
                    "WHERE state = 'leased' AND lease_expires <= ? AND attempts >= ?",
                    (now, max_chunk_attempts),
                )
            chunks = db.execute(
                "UPDATE chunks SET state = 'pending', holder = NULL, lease_expires = NULL "
                "WHERE state = 'leased' AND lease_expires <= ?",
                (now,),
            ).rowcount
            shards = db.execute(
                "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                "WHERE state = 'leased' AND lease_expires <= ?",
                (now,),
            ).rowcount
            lost = db.execute(
                "UPDATE workers SET state = 'lost' WHERE state = 'active' AND last_seen <= ?", (now - ttl_s,)
            ).rowcount
        return {"chunks": chunks, "shards": shards, "workers": lost}

    # -- chunks (data workers) ------------------------------------------------------------------

    def lease_chunk(
        self, worker_id: str, ttl_s: float, max_attempts: int = 0, max_ready: int = 0, slots: int = 0
    ) -> ChunkLease | str:
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
                return "wait" if waiting else "done"
            db.execute(
                "UPDATE chunks SET state = 'leased', holder = ?, lease_expires = ?, attempts = attempts + 1 WHERE id = ?",
                (worker_id, leases.lease_deadline(self.clock(), ttl_s), row["id"]),
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
    ) -> Completion:
        """Record the chunk's one shard. First completion wins; a retry of it is answered again."""
        with self._tx() as db:
            prior = db.execute(
                "SELECT id, chunk_id FROM shards WHERE completion_id = ?", (completion_id,)
            ).fetchone()
            if prior is not None:
                return Completion(prior["chunk_id"] == chunk_id, "already recorded", prior["id"])
            chunk = db.execute("SELECT state, split FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
            if chunk is None:
                return Completion(False, f"unknown chunk {chunk_id}")
            if chunk["state"] == "done":
                return Completion(False, "chunk already has a shard")
            if chunk["state"] == "quarantined":
                return Completion(False, "chunk is quarantined")
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

    # -- shards (learners) ----------------------------------------------------------------------

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
    ) -> ShardLease | str:
        """A train shard with rows nobody has trained on, or "wait", or "done" ("wait-dealt":
        wait, the learner's next dealt shard is being made).

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
            own_work_coming = (
                slots > 0
                and slot is not None
                and any(
                    positions[r["id"]] % slots == slot
                    for r in db.execute(
                        "SELECT id FROM chunks WHERE split = 'train' AND state IN ('pending', 'leased')"
                    ).fetchall()
                )
            )
            while True:
                choice = deal.choose_shard(candidates, slot, slots, vacant, own_work_coming)
                if choice.shard_id is None:
                    if own_work_coming:
                        return "wait-dealt"
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
                return ShardLease(row["id"], row["uri"], row["checksum"], row["rows"], todo, slot)
            unfinished_chunks = db.execute(
                "SELECT COUNT(*) FROM chunks WHERE split = 'train' AND state IN ('pending', 'leased')"
            ).fetchone()[0]
            open_shards = db.execute(
                "SELECT COUNT(*) FROM shards WHERE split = 'train' AND state != 'consumed'"
            ).fetchone()[0]
            return "wait" if unfinished_chunks or open_shards else "done"

    def report_corrupt_shard(self, shard_id: int, error: str) -> bool:
        """A shard that failed its checksum: take it out of play and reprocess its raw chunk."""
        with self._tx() as db:
            shard = db.execute("SELECT chunk_id, state FROM shards WHERE id = ?", (shard_id,)).fetchone()
            if shard is None or shard["state"] in ("corrupt", "consumed"):
                return False
            db.execute(
                "UPDATE shards SET state = 'corrupt', holder = NULL, lease_expires = NULL WHERE id = ?",
                (shard_id,),
            )
            db.execute(
                "UPDATE chunks SET state = 'pending', holder = NULL, lease_expires = NULL, error = ? "
                "WHERE id = ?",
                (f"shard {shard_id} corrupt: {error}"[:2000], shard["chunk_id"]),
            )
            _bump(db, "shards_corrupt", 1)
            return True

    def release_shards(self, worker_id: str, shard_ids: Iterable[int]) -> None:
        with self._tx() as db:
            for sid in shard_ids:
                db.execute(
                    "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                    "WHERE id = ? AND holder = ? AND state = 'leased'",
                    (sid, worker_id),
                )

    def shard(self, shard_id: int) -> sqlite3.Row | None:
        rows = self._q("SELECT * FROM shards WHERE id = ?", (shard_id,))
        return rows[0] if rows else None

    # -- pushes and merges ----------------------------------------------------------------------

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
    ) -> str | None:
        """Record a received push with the shard rows it trained on. Returns a refusal reason or None.

        Spans must lie inside their shard and not overlap each other (else the push is malformed
        and refused). Rows already merged or pending for someone else (a learner that lost its
        lease, then came back) are cut out of the spans: the delta still merges, but those rows
        are counted once, by whoever had them first. That is the guard against counting twice.
        """
        with self._tx() as db:
            if state == "pending":
                by_shard: dict[int, list[leases.Range]] = {}
                for sid, a, b in spans:
                    by_shard.setdefault(sid, []).append((a, b))
                if any(leases.overlaps(ranges) for ranges in by_shard.values()):
                    return "spans of this push overlap each other"
                kept: list[tuple[int, int, int]] = []
                for sid, a, b in spans:
                    shard = db.execute("SELECT rows FROM shards WHERE id = ?", (sid,)).fetchone()
                    if shard is None or not 0 <= a < b <= shard["rows"]:
                        return f"span {sid}:[{a},{b}) is not inside a known shard"
                    fresh = leases.subtract((a, b), self._spans(db, sid, ("merged", "pending")))
                    kept.extend((sid, x, y) for x, y in fresh)
                    _bump(db, "rows_trained_twice", (b - a) - sum(y - x for x, y in fresh))
                spans = kept
            db.execute(
                "INSERT INTO pushes(push_id, worker_id, fragment, base_version, steps, tokens, state, reason, received) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                ),
            )
            if state == "pending":
                db.executemany(
                    "INSERT INTO spans(shard_id, row_start, row_end, push_id) VALUES (?, ?, ?, ?)",
                    [(sid, a, b, push_id) for sid, a, b in spans],
                )
            for sid in released:
                db.execute(
                    "UPDATE shards SET state = 'ready', holder = NULL, lease_expires = NULL "
                    "WHERE id = ? AND holder = ? AND state = 'leased'",
                    (sid, worker_id),
                )
            # Trained tokens are counted from the rows the push names, not from its `tokens`
            # field: with several fragments every fragment's push reports the same tokens.
            _bump(db, "tokens_trained", self._span_tokens(db, spans))
            _bump(db, "pushes_refused" if state == "dropped" else "pushes_received", 1)
        return None

    def _span_tokens(self, db: sqlite3.Connection, spans: Sequence[tuple[int, int, int]]) -> int:
        total = 0
        for sid, a, b in spans:
            shard = db.execute("SELECT rows, tokens FROM shards WHERE id = ?", (sid,)).fetchone()
            if shard is not None and shard["rows"]:
                total += (b - a) * (shard["tokens"] // shard["rows"])
        return total

    def commit_merge(
        self,
        fragment: int,
        version: int,
        push_ids: Sequence[str],
        tokens: int,
        steps: int,
        mean_loss: float | None,
        reason: str,
        scale: float = 1.0,
    ) -> None:
        self.commit_merges(
            fragment, [MergeRecord(version, tuple(push_ids), tokens, steps, mean_loss, reason, scale)]
        )

    def commit_merges(self, fragment: int, merges: Sequence[MergeRecord]) -> None:
        """One transaction: the rounds, their pushes merged, their shards' rows counted, version on.

        Several merges of one fragment may share a transaction (and one checkpoint file, that of
        the last): the coordinator publishes merges in groups when merging outpaces the store.
        """
        if not merges:
            return
        with self._tx() as db:
            for merge in merges:
                self._commit_one_merge(db, fragment, merge)
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                (f"fragment_version.{fragment}", str(merges[-1].version)),
            )

    def _commit_one_merge(self, db: sqlite3.Connection, fragment: int, merge: MergeRecord) -> None:
        push_ids = merge.push_ids
        marks = ",".join("?" * len(push_ids))
        db.execute(
            f"UPDATE pushes SET state = 'merged', merged_version = ? WHERE state = 'pending' AND push_id IN ({marks})",
            (merge.version, *push_ids),
        )
        db.execute(
            "INSERT INTO rounds(fragment, version, closed, pushes, tokens, steps, mean_loss, reason, scale) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                fragment,
                merge.version,
                self.clock(),
                len(push_ids),
                merge.tokens,
                merge.steps,
                merge.mean_loss,
                merge.reason,
                merge.scale,
            ),
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
            for a, b in db.execute(
                f"SELECT row_start, row_end FROM spans WHERE shard_id = ? AND push_id IN ({marks})",
                (sid, *push_ids),
            ).fetchall():
                merged_tokens += (b - a) * per_row
            if leases.covered_rows(self._spans(db, sid, ("merged",))) >= shard["rows"]:
                db.execute(
                    "UPDATE shards SET state = 'consumed', holder = NULL, lease_expires = NULL WHERE id = ?",
                    (sid,),
                )
        _bump(db, "tokens_merged", merged_tokens)
        _bump(db, "rounds", 1)

    def drop_pushes(self, push_ids: Sequence[str], reason: str) -> None:
        """Pushes that will never merge: their rows become trainable again."""
        with self._tx() as db:
            for pid in push_ids:
                db.execute(
                    "UPDATE pushes SET state = 'dropped', reason = ? WHERE push_id = ? AND state = 'pending'",
                    (reason, pid),
                )

    def fragment_version(self, fragment: int) -> int:
        return int(self.get_meta(f"fragment_version.{fragment}", "0") or 0)

    # -- reporting ------------------------------------------------------------------------------

    def bump(self, name: str, by: float = 1) -> None:
        with self._tx() as db:
            _bump(db, name, by)

    def counter(self, name: str) -> float:
        return float(self._one("SELECT value FROM counters WHERE name = ?", (name,)) or 0)

    def counters(self) -> dict[str, float]:
        return {r["name"]: r["value"] for r in self._q("SELECT name, value FROM counters")}

    def summary(self) -> dict[str, Any]:
        """Counts for status and summary.json."""

        def count(sql: str, args: Sequence[Any] = ()) -> int:
            return int(self._one(sql, args) or 0)

        return {
            "chunks_total": count("SELECT COUNT(*) FROM chunks"),
            "chunks_done": count("SELECT COUNT(*) FROM chunks WHERE state = 'done'"),
            "chunks_quarantined": count("SELECT COUNT(*) FROM chunks WHERE state = 'quarantined'"),
            "shards_total": count("SELECT COUNT(*) FROM shards"),
            "shards_consumed": count(
                "SELECT COUNT(*) FROM shards WHERE split = 'train' AND state = 'consumed'"
            ),
            "tokens_prepared": count("SELECT COALESCE(SUM(tokens), 0) FROM shards"),
            "rounds": count("SELECT COUNT(*) FROM rounds"),
            "quarantined": [
                {"chunk": r["id"], "error": r["error"]}
                for r in self._q("SELECT id, error FROM chunks WHERE state = 'quarantined' ORDER BY id")
            ],
            "eval_shards": [
                {"uri": r["uri"], "checksum": r["checksum"], "rows": r["rows"]}
                for r in self._q(
                    "SELECT uri, checksum, rows FROM shards WHERE split = 'eval' ORDER BY chunk_id"
                )
            ],
            "first_round_loss": self._one("SELECT mean_loss FROM rounds ORDER BY closed LIMIT 1"),
            "last_round_loss": self._one("SELECT mean_loss FROM rounds ORDER BY closed DESC LIMIT 1"),
            "counters": self.counters(),
        }

    def chunk_shard_pairs(self) -> list[tuple[int, int, str]]:
        """(chunk id, number of shards recorded for it, chunk state) for every chunk."""
        rows = self._q(
            "SELECT c.id, COUNT(s.id), c.state FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id ORDER BY c.id"
        )
        return [(r[0], r[1], r[2]) for r in rows]


class _Transaction:
    """`with ledger._tx() as db:` — BEGIN IMMEDIATE ... COMMIT, under the ledger's lock."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def __enter__(self) -> sqlite3.Connection:
        self.ledger._lock.acquire()
        self.ledger._db.execute("BEGIN IMMEDIATE")
        return self.ledger._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.ledger._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.ledger._lock.release()


def _bump(db: sqlite3.Connection, name: str, by: float) -> None:
    db.execute(
        "INSERT INTO counters(name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
        (name, by),
    )
