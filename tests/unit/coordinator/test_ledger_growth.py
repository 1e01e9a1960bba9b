"""What a long run asks of its ledger over and over must not walk everything the run recorded.

A week's ledger holds every push and round ever made, a large dataset's many chunks and shards.
The statements Status, the ticker and a restarting coordinator run are captured as SQLite
executes them and their query plans checked: none scans every push or round, and the ticker
scans no chunk or shard table (benchmarks/ledger_scale.py measures what the scans cost).
"""

import sqlite3

from tests.support import commit_merge
from tests.unit.coordinator.ledger_setup import TTL, push, with_train_shard


def executed(ledger, call) -> list[str]:
    """The SQL statements `call` made the ledger run, with their values bound, on its write
    connection and on the reader that reports use."""
    ledger._read("SELECT 1")  # the reader opens on first use: open it to trace it
    connections = (ledger._db, ledger._reader)
    seen: list[str] = []
    for db in connections:
        db.set_trace_callback(seen.append)
    try:
        call()
    finally:
        for db in connections:
            db.set_trace_callback(None)
    return [s for s in seen if s.split(None, 1)[0].upper() in ("SELECT", "UPDATE", "DELETE")]


def scans(db: sqlite3.Connection, sql: str, tables=("pushes", "rounds")) -> list[str]:
    """The steps of `sql`'s plan that walk all of one of `tables`: a SCAN, unless it is of a
    partial index (the pending pushes: a handful) or an ordered index the statement's LIMIT stops."""
    plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql)]
    bounded = ("USING INDEX pushes_pending",) + (("USING INDEX",) if " LIMIT " in sql else ())
    return [
        step
        for step in plan
        if any(step.startswith(f"SCAN {t}") for t in tables) and not any(b in step for b in bounded)
    ]


def test_status_restart_and_rounds_lookups_use_indexes_and_answer_the_same(ledger, clock) -> None:
    (sid,) = with_train_shard(ledger)
    for worker in ("L1", "L2", "L3"):
        ledger.join(worker, "compute", "h")
    started = clock()
    assert push(ledger, "p1", [(sid, 0, 2)], worker="L1") is None
    clock.advance(1)
    assert push(ledger, "p2", [(sid, 2, 4)], worker="L2") is None
    clock.advance(1)
    assert push(ledger, "p3", [(sid, 4, 6)], worker="L1") is None
    commit_merge(ledger, 0, 1, ["p1", "p2"], 0, 0, None, "quorum")

    # What each answers (L3 never pushed; p3 is L1's newest and still pending).
    assert ledger.last_pushes() == {"L1": (started + 2, 0, 0), "L2": (started + 1, 0, 0)}
    assert ledger.pending_pushers() == {0: frozenset({"L1"})}
    assert ledger.round_pushers(0, 1) == (started, frozenset({"L1", "L2"}))
    assert ledger.summary()["rounds"] == 1

    def status() -> None:
        ledger.summary()
        ledger.last_pushes()
        ledger.workers()

    def restart() -> None:
        ledger.pending_pushers()
        ledger.round_pushers(0, 1)
        ledger.next_epoch()

    reported = executed(ledger, status)
    assert any("FROM workers w JOIN pushes" in s for s in reported)  # the capture saw the reader's
    statements = [*reported, *executed(ledger, restart)]
    assert any("state = 'pending'" in s for s in statements)  # ... and the write connection's
    assert {s: found for s in statements if (found := scans(ledger._db, s))} == {}
    # The ticker's lease expiry, 4 times a second: by state, not through every chunk and shard.
    ticks = executed(ledger, lambda: ledger.reclaim_expired(TTL, 3))
    assert len(ticks) >= 3
    assert {s: found for s in ticks if (found := scans(ledger._db, s, ("chunks", "shards")))} == {}
    assert ledger.push_state("p3")["state"] == "dropped"  # next_epoch did its work through the index
