"""Helpers the tests share that are not fixtures (fixtures live in conftest.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from diloco.coordinator.ledger import Ledger, MergeRecord


class FakeClock:
    """A clock the test moves: decisions read it, nothing sleeps."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def commit_merge(
    ledger: Ledger,
    fragment: int,
    version: int,
    push_ids: Sequence[str],
    tokens: int,
    steps: int,
    mean_loss: float | None,
    reason: str,
) -> None:
    """One merge of `fragment`, committed on its own (the publisher commits them in groups)."""
    ledger.commit_merges(fragment, [MergeRecord(version, tuple(push_ids), tokens, steps, mean_loss, reason)])


def shard_row(ledger: Ledger, shard_id: int) -> sqlite3.Row | None:
    rows = ledger._q("SELECT * FROM shards WHERE id = ?", (shard_id,))
    return rows[0] if rows else None
