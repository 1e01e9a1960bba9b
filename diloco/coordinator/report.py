"""Read-only questions about a run's ledger, for its summary (diloco run) and the benchmarks.

Opened read-only, so they can be asked while the coordinator runs, or after it is gone.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from diloco.coordinator.ledger import ledger_path


@contextlib.contextmanager
def read_only(workdir: str | Path) -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(f"file:{ledger_path(workdir)}?mode=ro", uri=True)
    try:
        yield db
    finally:
        db.close()


def longest_merge_gap(workdir: str | Path) -> float:
    """The longest time between two merges (any fragment): how long the syncer made no progress."""
    with read_only(workdir) as db:
        closed = [r[0] for r in db.execute("SELECT closed FROM rounds ORDER BY closed")]
    return round(max((b - a for a, b in zip(closed, closed[1:], strict=False)), default=0.0), 2)


def rounds_by_pushes(workdir: str | Path) -> dict[str, int]:
    """Merged rounds by how many pushes each held: with quorum 1, rounds of one push where every
    learner could have met in one are what costs Decoupled DiLoCo eval loss."""
    with read_only(workdir) as db:
        rows = db.execute("SELECT pushes, COUNT(*) FROM rounds GROUP BY pushes ORDER BY pushes").fetchall()
    return {str(pushes): count for pushes, count in rows}


def stored_run(workdir: str | Path) -> tuple[str, list[int]]:
    """The run's config (JSON, as the coordinator stored it: vocab_size filled in) and every
    fragment's published version: what names the global model."""
    if not ledger_path(workdir).exists():
        raise FileNotFoundError(f"{workdir} holds no run (no {ledger_path(workdir)})")
    with read_only(workdir) as db:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    versions = {int(k.split(".")[1]): int(v) for k, v in meta.items() if k.startswith("fragment_version.")}
    return meta.get("config", "{}"), [versions[p] for p in sorted(versions)]


def trained_param_count(workdir: str | Path) -> int | None:
    """The model's trained parameters, from the shapes its first learner offered (the running
    statistics that travel beside them not counted); None before any learner initialized the run.
    Read here, the count needs neither torch nor the user's model (built on the meta device, a
    model's init imported torch's compiler: seconds at the end of every local run)."""
    if not ledger_path(workdir).exists():
        return None
    with read_only(workdir) as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'param_specs'").fetchone()
    if row is None:
        return None
    return sum(math.prod(s["shape"]) for s in json.loads(row[0]) if not s.get("averaged"))


def tokens_reported(earlier_lives: float, learner_stats: Iterable[str | None]) -> int:
    """Tokens the learners say they trained: each one's latest count (its heartbeat stats, JSON),
    plus the last counts of earlier lives of restarted learners (work a kill threw away was still
    trained). The coordinator's status and a resumed job's starting point count it alike."""
    return int(earlier_lives) + sum(
        int(json.loads(s or "{}").get("tokens_trained", 0)) for s in learner_stats
    )
