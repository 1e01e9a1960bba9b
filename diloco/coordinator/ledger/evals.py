"""The held-out evaluations of published global models (the evaluator role's reports), and the
held-out rows they read."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from diloco.coordinator.ledger.db import LedgerBase


class EvalsTable(LedgerBase):
    def record_eval(
        self,
        worker_id: str,
        versions: Sequence[int],
        tokens_merged: int,
        loss: float,
        metrics: dict[str, float],
        rows: int,
        seconds: float,
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO evals(at, worker_id, versions, tokens_merged, loss, metrics, rows, seconds) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    self.clock(),
                    worker_id,
                    json.dumps([int(v) for v in versions]),
                    int(tokens_merged),
                    float(loss),
                    json.dumps(metrics, sort_keys=True),
                    int(rows),
                    float(seconds),
                ),
            )

    def evals(self, last: int | None = None) -> list[dict[str, Any]]:
        """Every evaluation (or the `last` ones), oldest first."""
        sql = "SELECT * FROM evals ORDER BY id DESC" + (" LIMIT ?" if last is not None else "")
        return eval_records(reversed(self._read(sql, (last,) if last is not None else ())))

    def eval_split(self) -> dict[str, Any]:
        """The held-out split as an evaluator reads it: its shards in chunk order up to the first
        eval chunk not yet prepared (so the rows read are the same every time, and grow only at
        the end), and whether that covers the whole split (quarantined chunks never will)."""
        chunks = self._read(
            "SELECT c.id, c.state, s.uri, s.checksum, s.rows FROM chunks c "
            "LEFT JOIN shards s ON s.chunk_id = c.id WHERE c.split = 'eval' ORDER BY c.id"
        )
        ready: list[dict[str, Any]] = []
        for r in chunks:
            if r["state"] == "quarantined":
                continue
            if r["uri"] is None:
                break
            ready.append({"uri": r["uri"], "checksum": r["checksum"], "rows": r["rows"]})
        pending = sum(1 for r in chunks if r["state"] != "quarantined" and r["uri"] is None)
        return {"shards": ready, "complete": pending == 0, "chunks": len(chunks)}

    def recalibration_split(self, rows: int) -> dict[str, Any]:
        """The train rows the global model's BatchNorm statistics are recomputed on (train_head)."""
        return {"shards": train_head(self._read(TRAIN_HEAD_SQL, (rows,)), rows) if rows > 0 else []}


# The train shards in chunk order (rows > 0: each holds a row, so `LIMIT rows` reads no more
# shards than can be needed); a corrupt one would fail its checksum.
TRAIN_HEAD_SQL = (
    "SELECT uri, checksum, rows FROM shards WHERE split = 'train' AND rows > 0 AND state != 'corrupt' "
    "ORDER BY chunk_id LIMIT ?"
)


def train_head(found: Iterable[Sequence[Any]], rows: int) -> list[dict[str, Any]]:
    """The first shards of TRAIN_HEAD_SQL's (uri, checksum, rows) that hold `rows` rows: where a
    model's running statistics are recomputed (eval.recalibrate_batches), the same rows every time."""
    shards, total = [], 0
    for uri, checksum, n in found:
        if total >= rows:
            break
        shards.append({"uri": uri, "checksum": checksum, "rows": int(n)})
        total += int(n)
    return shards


def eval_records(rows: Iterable[sqlite3.Row]) -> list[dict[str, Any]]:
    """Rows of the evals table as status and the summary show them, in the order given."""
    return [
        {
            "at": r["at"],
            "worker_id": r["worker_id"],
            "fragment_versions": json.loads(r["versions"]),
            "tokens_merged": r["tokens_merged"],
            "loss": r["loss"],
            "metrics": json.loads(r["metrics"]),
            "rows": r["rows"],
            "seconds": r["seconds"],
        }
        for r in rows
    ]
