"""What the ledger hands back: leases, completions, and the record of a merge."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from diloco.coordinator import leases
from diloco.data.types import ChunkSpec


class NoLease(enum.StrEnum):
    """Why a lease request got no lease."""

    WAIT = "wait"  # none free now: ask again soon
    WAIT_DEALT = "wait-dealt"  # wait: the learner's own next dealt shard is being made
    DONE = "done"  # none will come


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
    position: int = 0  # its place in the train chunks' lease order (what the deal deals by)
    reason: str = ""  # why this learner got it (deal.choose_shard): logged, so a deal can be traced


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
