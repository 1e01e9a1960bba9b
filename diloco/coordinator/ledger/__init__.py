"""The coordinator's durable state: chunks, shards, leases, workers, pushes, rounds.

One SQLite file in WAL mode. Every method that changes state runs in one transaction and returns
after the commit, so an RPC that answers has its effect on disk. Time comes from an injected clock
so lease expiry is tested with a fake one. Tensors never live here (see checkpoint.py).

Data accounting: a shard's rows count as trained only through *merged* spans. A span is recorded
with its push (state pending); the merge flips the push to merged in the same transaction that
records the round, so a dropped push or a dead learner leaves its rows untrained and leasable.
"""

from __future__ import annotations

from diloco.coordinator.ledger.chunks import ChunksTable
from diloco.coordinator.ledger.db import SCHEMA, LedgerBase, ledger_path
from diloco.coordinator.ledger.evals import EvalsTable
from diloco.coordinator.ledger.records import ChunkLease, Completion, MergeRecord, NoLease, ShardLease
from diloco.coordinator.ledger.report import ReportTable
from diloco.coordinator.ledger.rows import PushesTable
from diloco.coordinator.ledger.shards import ShardsTable
from diloco.coordinator.ledger.workers import WorkersTable

__all__ = [
    "SCHEMA",
    "ChunkLease",
    "Completion",
    "Ledger",
    "MergeRecord",
    "NoLease",
    "ShardLease",
    "ledger_path",
]


class Ledger(WorkersTable, ChunksTable, ShardsTable, PushesTable, ReportTable, EvalsTable, LedgerBase):
    """The run's ledger: one object, one transaction per method; each family of tables is a
    mixin in a file of its own (workers, chunks, shards, rows, report, evals) over the shared LedgerBase."""
