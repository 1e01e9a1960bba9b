"""The ledger's file: its one path, the schema, transactions, metadata, the epoch and counters."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from diloco.data.chunks import lease_positions
from diloco.data.types import ChunkSpec

# Why the pushes of an open round are dropped when the coordinator restarts. Such a push never
# merged: sent again (a learner asks again about each push it waited on), it is taken afresh.
DROPPED_BY_RESTART = "coordinator restarted before merge"

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
  last_seen REAL NOT NULL, state TEXT NOT NULL, stats TEXT NOT NULL DEFAULT '{}',
  caller TEXT                                     -- who joined it (coordinator/callers.py); NULL: not yet bound
);
CREATE TABLE IF NOT EXISTS pushes (
  push_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, fragment INTEGER NOT NULL,
  base_version INTEGER NOT NULL, steps INTEGER NOT NULL, tokens INTEGER NOT NULL,
  state TEXT NOT NULL,                            -- pending | merged | dropped
  merged_version INTEGER, reason TEXT, received REAL NOT NULL,
  norm REAL,                                      -- the delta's norm per H steps, for the outlier check
  ratio REAL, alignment REAL,                     -- as the pusher watch saw it (pusher_watch.py)
  deviation REAL,                                 -- per H steps, from the mean step (centered_clip.py)
  loss REAL                                       -- the training loss its learner reported (the watch's)
);
CREATE TABLE IF NOT EXISTS spans (
  shard_id INTEGER NOT NULL REFERENCES shards(id), row_start INTEGER NOT NULL,
  row_end INTEGER NOT NULL, push_id TEXT NOT NULL REFERENCES pushes(push_id)
);
CREATE INDEX IF NOT EXISTS spans_by_shard ON spans(shard_id);
CREATE INDEX IF NOT EXISTS spans_by_push ON spans(push_id);
-- A week's run holds millions of pushes, and a large dataset many chunks and shards: what
-- Status, the ticker (4 times a second), a restart and a round's lookup ask of them goes through
-- an index, never a scan of every row (benchmarks/ledger_scale.py).
CREATE INDEX IF NOT EXISTS pushes_by_worker ON pushes(worker_id, received);
CREATE INDEX IF NOT EXISTS pushes_pending ON pushes(fragment) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS pushes_by_merge ON pushes(fragment, merged_version) WHERE state = 'merged';
CREATE INDEX IF NOT EXISTS chunks_by_state ON chunks(state, lease_expires);
CREATE INDEX IF NOT EXISTS shards_by_state ON shards(state, lease_expires);
CREATE INDEX IF NOT EXISTS shards_by_split ON shards(split, state, tokens);
CREATE INDEX IF NOT EXISTS chunks_by_split ON chunks(split, state);
CREATE TABLE IF NOT EXISTS rounds (
  fragment INTEGER NOT NULL, version INTEGER NOT NULL, closed REAL NOT NULL,
  pushes INTEGER NOT NULL, tokens INTEGER NOT NULL, steps INTEGER NOT NULL,
  mean_loss REAL, reason TEXT, scale REAL NOT NULL DEFAULT 1.0, PRIMARY KEY (fragment, version)
);
CREATE INDEX IF NOT EXISTS rounds_by_close ON rounds(closed);
-- Every worker a shard was ever leased to (kept by the trigger, whatever code leases it): a
-- push may name rows only of shards its worker holds or held (a learner resumed after kill -9, or
-- a push sent again from its journal, names rows of a lease that has lapsed since).
CREATE TABLE IF NOT EXISTS shard_holders (
  shard_id INTEGER NOT NULL, worker_id TEXT NOT NULL, PRIMARY KEY (shard_id, worker_id)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS shard_holders_on_lease AFTER UPDATE OF holder ON shards
  WHEN NEW.holder IS NOT NULL
  BEGIN INSERT OR IGNORE INTO shard_holders(shard_id, worker_id) VALUES (NEW.id, NEW.holder); END;
-- Who held a lease, kept once it ends (lease_claims.py): a chunk's completion is taken only from
-- the data worker that leased that attempt, a shard's corruption report only from the learner
-- that leased it last (shard_last_holder), a few an hour (shard_reports: the reports taken).
CREATE TABLE IF NOT EXISTS chunk_attempts (
  chunk_id INTEGER NOT NULL, attempt INTEGER NOT NULL, worker_id TEXT NOT NULL, PRIMARY KEY (chunk_id, attempt)
);
CREATE TABLE IF NOT EXISTS shard_last_holder (shard_id INTEGER PRIMARY KEY, worker_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shard_reports (worker_id TEXT NOT NULL, shard_id INTEGER NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS shard_reports_by_worker ON shard_reports(worker_id, at);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL);
CREATE TABLE IF NOT EXISTS evals (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, worker_id TEXT NOT NULL,
  versions TEXT NOT NULL, tokens_merged INTEGER NOT NULL, loss REAL NOT NULL,
  metrics TEXT NOT NULL, rows INTEGER NOT NULL, seconds REAL NOT NULL
);
-- Who is named anywhere, by worker: a worker gone long and named nowhere is forgotten
-- (WorkersTable.forget_idle), one named is kept for good (its history holds its id).
CREATE INDEX IF NOT EXISTS shard_holders_by_worker ON shard_holders(worker_id);
CREATE INDEX IF NOT EXISTS chunk_attempts_by_worker ON chunk_attempts(worker_id);
CREATE INDEX IF NOT EXISTS evals_by_worker ON evals(worker_id);
"""


def ledger_path(workdir: str | Path) -> Path:
    """The one place a run's ledger lives: <workdir>/state/ledger.sqlite."""
    return Path(workdir) / "state" / "ledger.sqlite"


class LedgerBase:
    """The SQLite file and its plumbing; the tables' methods are in the mixins beside it."""

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
        _keep_worker_callers(self._db)
        _keep_push_claims(self._db)
        _keep_push_watch(self._db)
        # Reports (Status, the page, /metrics) read on a connection of their own: in WAL mode it
        # sees the last commit while the service writes on, so counting a large dataset's chunks
        # never holds up a push or a merge waiting for the ledger's lock.
        self._reader: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        self._positions: dict[int, int] | None = None
        # Tokens of each worker's pushes merged since this process opened the ledger (it ages the
        # learners' claims on the token budget between their heartbeats; lost with a restart,
        # which only makes the claims count in full again until each learner's next heartbeat).
        self._merged_by_worker: dict[str, int] = {}

    def close(self) -> None:
        with self._lock:
            self._db.close()
        with self._read_lock:
            if self._reader is not None:
                self._reader.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        rows = self._q(sql, args)
        return rows[0][0] if rows else None

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """A report's query, on the reader connection (the last commit, without the write lock)."""
        if self.path == ":memory:":  # one connection is the whole database
            return self._q(sql, args)
        with self._read_lock:
            if self._reader is None:
                self._reader = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._reader.row_factory = sqlite3.Row
                self._reader.execute("PRAGMA query_only = ON")
            return self._reader.execute(sql, args).fetchall()

    def _read_one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        rows = self._read(sql, args)
        return rows[0][0] if rows else None

    # -- meta -----------------------------------------------------------------------------------

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        value = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return default if value is None else value

    def set_meta(self, **values: str) -> None:
        with self._tx() as db:
            for key, value in values.items():
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def first_meta(self, key: str, value: str) -> str:
        """The value `key` holds, set to `value` when it held none: the first writer wins, at once."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", (key, value))
            return db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0]

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
        order = lease_positions(len(chunks), shuffle_seed)
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

    def pending_pushers(self) -> dict[int, frozenset[str]]:
        """Who sent the pushes still pending, by fragment: before `next_epoch`, the pushes a
        restart is about to drop."""
        out: dict[int, set[str]] = {}
        for row in self._q("SELECT DISTINCT fragment, worker_id FROM pushes WHERE state = 'pending'"):
            out.setdefault(int(row["fragment"]), set()).add(str(row["worker_id"]))
        return {p: frozenset(workers) for p, workers in out.items()}

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
                "UPDATE pushes SET state = 'dropped', reason = ? WHERE state = 'pending'",
                (DROPPED_BY_RESTART,),
            )
        return epoch

    # -- counters ---------------------------------------------------------------------------------

    def bump(self, name: str, by: float = 1) -> None:
        with self._tx() as db:
            _bump(db, name, by)

    def counter(self, name: str) -> float:
        return float(self._one("SELECT value FROM counters WHERE name = ?", (name,)) or 0)

    def tokens_merged_of(self, worker_id: str) -> int:
        """Tokens of this worker's pushes merged since the ledger was opened."""
        with self._lock:
            return self._merged_by_worker.get(worker_id, 0)

    def counters(self) -> dict[str, float]:
        return {r["name"]: r["value"] for r in self._q("SELECT name, value FROM counters")}


class _Transaction:
    """`with ledger._tx() as db:` — BEGIN IMMEDIATE ... COMMIT, under the ledger's lock."""

    def __init__(self, ledger: LedgerBase):
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


def _keep_worker_callers(db: sqlite3.Connection) -> None:
    """Workers' callers, in a ledger from before they were kept there too (only in memory, so a
    restarted coordinator bound each id to whoever called first): the column added, empty, so each
    such id goes to its first caller whose role fits it (callers.py), and its index."""
    if "caller" not in {row[1] for row in db.execute("PRAGMA table_info(workers)")}:
        db.execute("ALTER TABLE workers ADD COLUMN caller TEXT")
    db.execute("CREATE INDEX IF NOT EXISTS workers_by_caller ON workers(caller, state)")


def _keep_push_watch(db: sqlite3.Connection) -> None:
    """A ledger from before pushes kept what the pusher watch and the centered clip saw of them: the
    columns added, empty (each learner's watch after a restart starts from its pushes after it; a
    fragment's deviations are its norms, as if its momentum were zero)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(pushes)")}
    for column in ("ratio", "alignment", "deviation", "loss"):
        if column not in have:
            db.execute(f"ALTER TABLE pushes ADD COLUMN {column} REAL")


def _keep_push_claims(db: sqlite3.Connection) -> None:
    """A ledger from before pushes kept their norms and shards their past holders: the norm column
    added (empty: the outlier history restarts from the pushes after it), and the holders seeded,
    once, from what the ledger knows of them: each shard's current holder and every worker whose
    push named its rows."""
    if "norm" not in {row[1] for row in db.execute("PRAGMA table_info(pushes)")}:
        db.execute("ALTER TABLE pushes ADD COLUMN norm REAL")
    if db.execute("SELECT 1 FROM meta WHERE key = 'shard_holders_seeded'").fetchone() is None:
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "INSERT OR IGNORE INTO shard_holders(shard_id, worker_id) "
            "SELECT id, holder FROM shards WHERE holder IS NOT NULL"
        )
        db.execute(
            "INSERT OR IGNORE INTO shard_holders(shard_id, worker_id) "
            "SELECT DISTINCT s.shard_id, p.worker_id FROM spans s JOIN pushes p USING (push_id)"
        )
        db.execute("INSERT INTO meta(key, value) VALUES ('shard_holders_seeded', '1')")
        db.execute("COMMIT")


def _bump(db: sqlite3.Connection, name: str, by: float) -> None:
    db.execute(
        "INSERT INTO counters(name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
        (name, by),
    )
