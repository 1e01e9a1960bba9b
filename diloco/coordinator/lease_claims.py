"""Who may act on a lease once it is handed out: pure decisions, the ledger's rows in, a verdict
and its reason out.

- A chunk's completion is taken from the data worker that leased that attempt of the chunk, for
  the file that attempt was told to write (`attempt_shard_uri`), while it holds the lease, or once
  it lapsed when nobody has taken the chunk since (slow work is still good work).
- A shard's corruption report is taken from the learner that leased the train shard last (an
  honest learner gives the lease back before it reports), at most MAX_SHARD_REPORTS in
  SHARD_REPORT_WINDOW_S per learner: each report has a data worker make the chunk again.

Before, any data worker replaced any chunk's shard with a file of its choosing, and any learner
sent every shard, the held-out ones too, back to be made again (red-team report, 8 and 10).

A caller whose lease is over (it lapsed and another took it, or the chunk has its shard) is
answered as before: not taken, nothing changed (`Refusal.STALE`), and its data worker deletes its
surplus file. A caller that never held the lease is refused (`Refusal.DENIED`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from diloco import store

# Accepted corruption reports per learner in a window: a real checksum failure is rare (a bad disk
# or a torn write), and each report costs a data worker a whole chunk made again.
MAX_SHARD_REPORTS = 16
SHARD_REPORT_WINDOW_S = 3600.0

_SHARD_NAME = re.compile(r"chunk-(\d+)-a(\d+)\.shard")


class Refusal(enum.Enum):
    STALE = "stale"  # the caller's lease is over: answered "not taken"; nothing changes
    DENIED = "denied"  # the caller never held it: PERMISSION_DENIED
    TOO_MANY = "too many"  # more reports than a learner makes: RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Verdict:
    refusal: Refusal | None
    reason: str

    @property
    def taken(self) -> bool:
        return self.refusal is None


def attempt_shard_uri(shard_root: str, chunk_id: int, attempt: int) -> str:
    """The one file attempt `attempt` of chunk `chunk_id` writes its shard to (LeaseChunk names it)."""
    return store.join(shard_root, f"chunk-{chunk_id:06d}-a{attempt}.shard")


def attempt_of(shard_root: str, chunk_id: int, uri: str) -> int | None:
    """Which attempt of chunk `chunk_id` names `uri` as its shard file; None: no attempt does."""
    name = uri.rsplit("/", 1)[-1]
    match = _SHARD_NAME.fullmatch(name)
    if match is None or int(match[1]) != chunk_id:
        return None
    attempt = int(match[2])
    return attempt if attempt >= 1 and uri == attempt_shard_uri(shard_root, chunk_id, attempt) else None


@dataclass(frozen=True)
class ChunkRow:
    """What a completion is judged by: the chunk's row, who leased the attempt named (None: no
    record), and the file of the chunk's shard when it has one (None: none yet)."""

    state: str  # pending | leased | done | quarantined
    holder: str | None
    attempts: int
    attempt_holder: str | None
    recorded_uri: str | None


def completion_verdict(worker_id: str, chunk_id: int, attempt: int, uri: str, chunk: ChunkRow) -> Verdict:
    """Whether `worker_id`'s completion of attempt `attempt` of chunk `chunk_id` (its shard in
    `uri`) is taken. (A retry of a completion already recorded is answered before this.)"""
    if chunk.attempts == 0:  # nobody was ever given it: nobody made its shard
        return Verdict(Refusal.DENIED, f"chunk {chunk_id} was never leased")
    current = attempt == chunk.attempts
    holds = chunk.state == "leased" and chunk.holder == worker_id and current
    # (A lease handed out before these records were kept has its holder only.)
    if not holds and chunk.attempt_holder != worker_id:
        return Verdict(Refusal.DENIED, f"attempt {attempt} of chunk {chunk_id} was not leased to {worker_id}")
    if holds:
        return Verdict(None, "the lease holder's attempt")
    if chunk.state == "done":
        return Verdict(Refusal.STALE, "chunk already has a shard")
    if chunk.state == "quarantined":
        return Verdict(Refusal.STALE, "chunk is quarantined")
    if chunk.state == "leased" or not current:
        return Verdict(
            Refusal.STALE,
            f"chunk {chunk_id} was leased again (attempt {chunk.attempts}): attempt {attempt} is over",
        )
    if uri == chunk.recorded_uri:  # a file reported corrupt: its chunk is being made again
        return Verdict(Refusal.STALE, f"{uri} was reported corrupt; chunk {chunk_id} is to be made again")
    return Verdict(None, "the lease lapsed and nobody has taken the chunk since")


@dataclass(frozen=True)
class ShardRow:
    """What a corruption report is judged by: the shard's row, who leased it last (None: nobody),
    whether the reporter ever leased it, and the reports it made in the window."""

    split: str
    state: str  # ready | leased | consumed | corrupt
    holder: str | None
    last_holder: str | None
    held_before: bool
    recent_reports: int


def report_verdict(worker_id: str, shard_id: int, shard: ShardRow) -> Verdict:
    """Whether `worker_id`'s report that shard `shard_id` is corrupt is taken."""
    if shard.split != "train" or not shard.held_before:
        return Verdict(Refusal.DENIED, f"shard {shard_id} is not a train shard {worker_id} leased")
    if shard.state in ("corrupt", "consumed"):
        return Verdict(Refusal.STALE, f"shard {shard_id} is {shard.state} already")
    last = shard.holder if shard.state == "leased" else shard.last_holder
    if last != worker_id:
        return Verdict(Refusal.STALE, f"shard {shard_id} has been leased to another learner since")
    if shard.recent_reports >= MAX_SHARD_REPORTS:
        return Verdict(
            Refusal.TOO_MANY,
            f"{worker_id} reported {shard.recent_reports} shards corrupt in the last "
            f"{SHARD_REPORT_WINDOW_S:.0f} s ({MAX_SHARD_REPORTS} at most): is its own disk or cache failing?",
        )
    return Verdict(None, "its last holder's report")
