"""The fuzzer's oracle (diloco.testing.fuzz): whether a call on the coordinator's objects must be
refused, judged from the call's own facts (who leased what, per the ledger's plain tables; what
the delta holds) and the contract the README states, never by asking the code under test.

A verdict is REFUSE (the call must be refused and change nothing), HONEST (a well-behaved
worker's call on its own objects: it should be taken; a refusal is reported, not failed) or
EITHER (the facts do not settle it: a fuzzed file's contents, a claim the coordinator credits
down). The rules, each one line of the README's security section:

- a delta names rows only of train shards leased to its worker, not corrupt, inside the shard,
  not all in other workers' pushes, none in its own earlier push (re-sent work); a delta naming
  no rows needs a train shard held now, and not a row-less push of the fragment just before;
- a delta's norm is at most 10x the fragment's parameter norm per H steps credited, and steps are
  credited only as far as the rows reach: so a norm above 10x the parameter norm times every
  train row's steps over H is refused whatever it claims;
- a shard's corruption report is taken only from the learner that leased the train shard last,
  MAX_SHARD_REPORTS of its reports an hour at most;
- a chunk's completion only from the data worker that leased that attempt, for the file the lease
  named (the fuzzer's own record of its LeaseChunk replies).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.coordinator.lease_claims import MAX_SHARD_REPORTS

MAX_DELTA_TO_PARAMS = 10.0  # README: 10x the fragment's parameter norm per H steps


class Verdict(enum.Enum):
    REFUSE = "refuse"
    HONEST = "honest"
    EITHER = "either"


@dataclass
class Tally:
    """What the fuzzer did, for the benchmark's report."""

    calls: int = 0
    refused: int = 0
    accepted_pushes: int = 0
    refused_pushes: int = 0
    must_refuse: int = 0  # calls the policy or the oracle says must be refused...
    must_refuse_refused: int = 0  # ...and were
    must_refuse_accepted: int = 0  # ...and were taken: a defect (the run stops at the first)
    honest: int = 0  # a well-behaved worker's calls on its own objects
    honest_refused: int = 0  # ...refused all the same (reported, not failed)
    by_call: dict[str, int] = field(default_factory=dict)
    must_refuse_by_reason: dict[str, int] = field(default_factory=dict)
    honest_refused_by_reason: dict[str, int] = field(default_factory=dict)
    defects: list[str] = field(default_factory=list)

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class Facts:
    """The ledger's plain tables, read as they are (`query`: Ledger._q)."""

    def __init__(self, query: Callable[..., list[Any]]) -> None:
        self.q = query

    def guarded_state(self) -> tuple:
        """What a refused call must not change: who is joined, who holds which lease, which
        pushes will merge (a merge of an earlier push may consume a shard meanwhile: not compared)."""
        q = self.q
        return (
            [tuple(r) for r in q("SELECT id, role, state, caller FROM workers ORDER BY id")],
            [tuple(r) for r in q("SELECT id, state, holder, attempts FROM chunks ORDER BY id")],
            {r[0]: (r[1], r[2]) for r in q("SELECT id, state, holder FROM shards")},
            {r[0] for r in q("SELECT push_id FROM pushes WHERE state IN ('pending', 'merged')")},
        )

    def rows_merged_twice(self) -> tuple | None:
        """Two merged pushes' overlapping spans (shard, start, end, push, push), or None."""
        twice = self.q(
            "SELECT a.shard_id, a.row_start, a.row_end, a.push_id, b.push_id FROM spans a JOIN spans b "
            "ON a.shard_id = b.shard_id AND a.push_id < b.push_id AND a.row_start < b.row_end AND "
            "b.row_start < a.row_end JOIN pushes p ON p.push_id = a.push_id JOIN pushes q ON q.push_id = b.push_id "
            "WHERE p.state = 'merged' AND q.state = 'merged' LIMIT 1"
        )
        return tuple(twice[0]) if twice else None

    def reports_taken(self, worker: str) -> int:
        """How many of `worker`'s corruption reports were taken (lease_claims.MAX_SHARD_REPORTS
        an hour at most)."""
        return int(self.q("SELECT COUNT(*) FROM shard_reports WHERE worker_id = ?", (worker,))[0][0])

    def shard(self, sid: int) -> Any:
        rows = self.q("SELECT id, rows, tokens, split, state, holder FROM shards WHERE id = ?", (sid,))
        return rows[0] if rows else None

    def shards(self, split: str | None = None) -> list[Any]:
        return self.q(
            "SELECT id, rows, tokens, split, state, holder FROM shards WHERE split = ? OR ? IS NULL ORDER BY id",
            (split, split),
        )

    def ever_leased(self, sid: int, worker: str) -> bool:
        return bool(self.q("SELECT 1 FROM shard_holders WHERE shard_id = ? AND worker_id = ?", (sid, worker)))

    def last_holder(self, sid: int) -> str | None:
        shard = self.shard(sid)
        if shard is not None and shard["state"] == "leased":
            return shard["holder"]
        rows = self.q("SELECT worker_id FROM shard_last_holder WHERE shard_id = ?", (sid,))
        return rows[0][0] if rows else None

    def pushed_rows(self, sid: int) -> list[tuple[int, int, str]]:
        """Rows of shard `sid` in pending or merged pushes: (start, end, worker)."""
        rows = self.q(
            "SELECT s.row_start, s.row_end, p.worker_id FROM spans s JOIN pushes p ON p.push_id = s.push_id "
            "WHERE s.shard_id = ? AND p.state IN ('pending', 'merged')",
            (sid,),
        )
        return [(int(r[0]), int(r[1]), str(r[2])) for r in rows]

    def last_push_named_rows(self, worker: str, fragment: int) -> bool | None:
        """Whether `worker`'s last pending or merged push of `fragment` named rows (None: none)."""
        rows = self.q(
            "SELECT push_id FROM pushes WHERE worker_id = ? AND fragment = ? AND state IN ('pending', 'merged') "
            "ORDER BY received DESC LIMIT 1",
            (worker, fragment),
        )
        if not rows:
            return None
        return bool(self.q("SELECT 1 FROM spans WHERE push_id = ? LIMIT 1", (rows[0][0],)))

    def live(self, worker: str) -> bool:
        return bool(self.q("SELECT 1 FROM workers WHERE id = ? AND state = 'active'", (worker,)))

    def ever_leased_tokens(self, worker: str) -> tuple[int, int]:
        """Rows and tokens of every train shard ever leased to `worker`."""
        row = self.q(
            "SELECT COALESCE(SUM(s.rows), 0), COALESCE(SUM(s.tokens), 0) FROM shards s "
            "JOIN shard_holders h ON h.shard_id = s.id WHERE h.worker_id = ? AND s.split = 'train'",
            (worker,),
        )[0]
        return int(row[0]), int(row[1])


def _overlap(a: int, b: int, x: int, y: int) -> int:
    return max(0, min(b, y) - max(a, x))


def push_verdict(
    facts: Facts,
    worker: str,
    fragment: int,
    spans: Sequence[tuple[int, int, int]],
    malformed: str,
    delta_norm: float,
    param_norm: float,
    max_steps: int,
    h: int,
) -> tuple[Verdict, str]:
    """Whether `worker`'s push of a delta of norm `delta_norm` naming `spans` must be refused.
    `malformed`: why its tensors or header are malformed ("" when they are not); `max_steps`:
    every train row of the run in steps (the most any push can be credited)."""
    if malformed:
        return Verdict.REFUSE, malformed
    if not facts.live(worker):
        return Verdict.REFUSE, "pushed as a worker that is not joined"
    reach = max(1.0, max_steps / h)
    if delta_norm > MAX_DELTA_TO_PARAMS * max(param_norm, 1e-2) * reach * 1.01:
        return Verdict.REFUSE, "delta norm far above the fragment's parameter norm"
    honest = True
    all_taken = bool(spans)
    for sid, a, b in spans:
        shard = facts.shard(sid)
        if shard is None or not 0 <= a < b <= shard["rows"]:
            return Verdict.REFUSE, "span outside its shard"
        if shard["split"] != "train" or shard["state"] == "corrupt":
            return Verdict.REFUSE, f"span in a {shard['state']} {shard['split']} shard"
        if not facts.ever_leased(sid, worker):
            return Verdict.REFUSE, "span in a shard never leased to the pusher"
        pushed = facts.pushed_rows(sid)
        if any(w == worker and _overlap(a, b, x, y) for x, y, w in pushed):
            return Verdict.REFUSE, "rows of the pusher's own earlier push (re-sent work)"
        others = sum(_overlap(a, b, x, y) for x, y, w in pushed if w != worker)
        all_taken = all_taken and others >= b - a  # (other pushes' spans never overlap each other)
        honest = honest and others == 0 and shard["state"] == "leased" and shard["holder"] == worker
    if all_taken:
        return Verdict.REFUSE, "every row named is in other workers' pushes"
    if not spans:
        # One fragment (the fuzzer's): the claim takes no row-less push at all (P - 1 = 0 of them);
        # with P >= 2 one may be backed by rows named before, a hand-in's (ledger/claims.py).
        held = [s for s in facts.shards("train") if s["state"] == "leased" and s["holder"] == worker]
        if not held:
            return Verdict.REFUSE, "no rows named and no train shard held"
        if facts.last_push_named_rows(worker, fragment) is False:
            return Verdict.REFUSE, "a second row-less delta in a row"
        return Verdict.EITHER, "row-less delta riding ahead of its rows"
    return (Verdict.HONEST, "own fresh rows") if honest else (Verdict.EITHER, "rows of a lease that ended")


def report_verdict(facts: Facts, worker: str, sid: int) -> tuple[Verdict, str]:
    """Whether `worker`'s report that shard `sid` is corrupt must be refused."""
    shard = facts.shard(sid)
    if shard is None or shard["split"] != "train":
        return Verdict.REFUSE, "not a train shard"
    if shard["state"] in ("corrupt", "consumed"):
        return Verdict.REFUSE, f"a {shard['state']} shard"
    if not facts.ever_leased(sid, worker) or facts.last_holder(sid) != worker:
        return Verdict.REFUSE, "a shard the reporter did not lease last"
    # A fuzz run is far shorter than the window: every report taken counts.
    if facts.reports_taken(worker) >= MAX_SHARD_REPORTS:
        return (
            Verdict.REFUSE,
            f"more than {MAX_SHARD_REPORTS} corrupt reports by one learner within the window",
        )
    return Verdict.HONEST, "its last holder's report"


def completion_verdict(
    leased: dict[tuple[int, str], str], worker: str, chunk: int, uri: str
) -> tuple[Verdict, str]:
    """Whether `worker`'s completion of chunk `chunk` into `uri` must be refused. `leased`: (chunk,
    the file its lease named) -> the worker the fuzzer saw lease it."""
    holder = leased.get((chunk, uri))
    if holder is None:
        return Verdict.REFUSE, "a file no lease of this chunk named to a fuzzer's worker"
    if holder != worker:
        return Verdict.REFUSE, "a chunk attempt leased to another data worker"
    return Verdict.EITHER, "its own attempt (the file's contents are fuzzed)"


def norm(tensors: dict[str, Any]) -> float:
    """The L2 norm over every tensor, in float64 (inf where it overflows)."""
    total = 0.0
    for t in tensors.values():
        value = float(t.double().norm()) if t.numel() else 0.0
        total += value * value
    return math.sqrt(total) if math.isfinite(total) else math.inf


def unchanged(before: tuple, after: tuple) -> bool:
    """Facts.guarded_state's two readings agree (a shard consumed meanwhile by a merge aside)."""
    shards = all(
        after[2].get(s) == v or (after[2].get(s) or ("",))[0] == "consumed" for s, v in before[2].items()
    )
    return before[:2] == after[:2] and shards and after[3] <= before[3]


def taken(what: str, reply: Any) -> bool:
    """Whether a call's reply says it was taken (a refusal may come as a reply, not an error)."""
    if reply is None:
        return False
    if what in ("push", "complete_chunk", "init"):
        return bool(reply.accepted)
    if what == "report_shard":
        return bool(reply.reprocessing)
    return True
