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
