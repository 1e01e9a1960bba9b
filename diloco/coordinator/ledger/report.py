"""What status reports from the ledger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diloco.coordinator.ledger.db import LedgerBase


class ReportTable(LedgerBase):
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
            "tokens_leased": count(
                "SELECT COALESCE(SUM(tokens), 0) FROM shards WHERE split = 'train' AND state IN ('leased', 'consumed')"
            ),
            "chunks_by_state": {
                r[0]: r[1]
                for r in self._q("SELECT state, COUNT(*) FROM chunks GROUP BY state ORDER BY state")
            },
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

    def last_pushes(self) -> dict[str, tuple[float, int, int]]:
        """Each worker's latest push: when it arrived (the ledger's clock), its fragment and the
        version it was based on."""
        # One pass: with MAX(), SQLite takes the other bare columns from the row holding the max.
        rows = self._q(
            "SELECT worker_id, MAX(received), fragment, base_version FROM pushes GROUP BY worker_id"
        )
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def chunk_shard_pairs(self) -> list[tuple[int, int, str]]:
        """(chunk id, number of shards recorded for it, chunk state) for every chunk."""
        rows = self._q(
            "SELECT c.id, COUNT(s.id), c.state FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id ORDER BY c.id"
        )
        return [(r[0], r[1], r[2]) for r in rows]
