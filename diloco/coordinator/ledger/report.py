"""What status reports from the ledger."""

from __future__ import annotations

from typing import Any

from diloco.coordinator.ledger.db import LedgerBase


class ReportTable(LedgerBase):
    def summary(self) -> dict[str, Any]:
        """Counts for status and summary.json."""

        # A few passes over a large dataset's index entries, on the reader (see LedgerBase._read).
        chunks_by_state = {
            r[0]: r[1] for r in self._read("SELECT state, COUNT(*) FROM chunks GROUP BY state ORDER BY state")
        }
        shards_total, tokens_prepared = self._read("SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM shards")[0]
        shards_consumed, tokens_leased = self._read(
            "SELECT COUNT(*) FILTER (WHERE state = 'consumed'), COALESCE(SUM(tokens), 0) FROM shards "
            "WHERE split = 'train' AND state IN ('leased', 'consumed')"
        )[0]
        # Train shards some rows of which a push carried (merged, pending, or since dropped):
        # what moves while a run trains, where "consumed" waits for every row of a shard to merge.
        shards_started = self._read("SELECT COUNT(DISTINCT shard_id) FROM spans")[0][0]
        train_tokens_prepared = self._read(
            "SELECT COALESCE(SUM(tokens), 0) FROM shards WHERE split = 'train'"
        )[0][0]
        counters = self.counters()
        return {
            "chunks_total": sum(chunks_by_state.values()),
            "chunks_done": chunks_by_state.get("done", 0),
            "chunks_quarantined": chunks_by_state.get("quarantined", 0),
            "shards_total": shards_total,
            "shards_consumed": shards_consumed,
            "shards_started": shards_started,
            "train_tokens_prepared": train_tokens_prepared,
            "tokens_prepared": tokens_prepared,
            "tokens_leased": tokens_leased,
            "chunks_by_state": chunks_by_state,
            # The merge's own counter: COUNT(*) walks every round a long run made.
            "rounds": int(counters.get("rounds", 0)),
            "quarantined": [
                {"chunk": r["id"], "error": r["error"]}
                for r in self._read("SELECT id, error FROM chunks WHERE state = 'quarantined' ORDER BY id")
            ],
            "eval_shards": [
                {"uri": r["uri"], "checksum": r["checksum"], "rows": r["rows"]}
                for r in self._read(
                    "SELECT uri, checksum, rows FROM shards WHERE split = 'eval' ORDER BY chunk_id"
                )
            ],
            "first_round_loss": self._read_one("SELECT mean_loss FROM rounds ORDER BY closed LIMIT 1"),
            "last_round_loss": self._read_one("SELECT mean_loss FROM rounds ORDER BY closed DESC LIMIT 1"),
            "counters": counters,
        }

    def last_pushes(self) -> dict[str, tuple[float, int, int]]:
        """Each worker's latest push: when it arrived (the ledger's clock), its fragment and the
        version it was based on."""
        # Per known worker, its newest push by the (worker_id, received) index: a scan of every
        # push ever made took Status (and every call waiting on the ledger) seconds in a long run.
        rows = self._read(
            "SELECT w.id, p.received, p.fragment, p.base_version FROM workers w JOIN pushes p "
            "ON p.rowid = (SELECT rowid FROM pushes WHERE worker_id = w.id ORDER BY received DESC LIMIT 1)"
        )
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def chunk_shard_pairs(self) -> list[tuple[int, int, str]]:
        """(chunk id, number of shards recorded for it, chunk state) for every chunk."""
        rows = self._q(
            "SELECT c.id, COUNT(s.id), c.state FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id ORDER BY c.id"
        )
        return [(r[0], r[1], r[2]) for r in rows]
