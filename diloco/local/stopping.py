"""Why a local run stopped, and what it lost to quarantine: the result table's lines beside its
figures (summary.json's `stopped`, `stopped_because`, `quarantine_reason` and
`eval_chunks_quarantined`). The decisions are pure functions; the two readers beside them take
their facts from the workdir once the job has stopped."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.coordinator.ledger.db import ledger_path
from diloco.coordinator.lifecycle import DATA_EXHAUSTED_REASON
from diloco.coordinator.report import read_only
from diloco.observe.events import KEEP_EVENTS, METRICS_LOG, read_events

# summary.json's `stopped`: one of these.
TOKEN_BUDGET = "token_budget"
TIME_LIMIT = "time_limit"
DATA_EXHAUSTED = "data_exhausted"
OPERATOR = "operator"
FINISH_ASKED = "finish_asked"  # the time limit or an operator: the limit was not known
LEARNERS_FAILED = "learners_failed"
UNKNOWN = "unknown"

# A learner's own reasons to leave (diloco.compute.schedule.loop_end); any other end ("stopped",
# "refused: ...", or no leave at all: killed) is a failure.
FINISHING, SHARE_TRAINED, NO_MORE_DATA = "run finishing", "token share trained", "no more data"
NORMAL_ENDS = (FINISHING, SHARE_TRAINED, NO_MORE_DATA)

# The quarantine reason summary.json keeps: a data worker's error holds a short traceback too.
REASON_CHARS = 500


@dataclass(frozen=True)
class Stop:
    code: str  # one of the constants above
    because: str  # one readable line


def stop_reason(
    *,
    tokens_merged: int,
    budget: int,
    wall_seconds: float,
    minutes: float | None,
    learner_ends: dict[str, str | None],
    finish_reason: str | None = None,
) -> Stop:
    """Why the run stopped, from what the summary knows.

    Args:
        tokens_merged: the ledger's merged tokens at the end.
        budget: train.max_tokens (0: none).
        wall_seconds: the job's training time, start to the last learner's exit.
        minutes: the job's time limit (--minutes; 0: none; None: not known).
        learner_ends: each learner's last leave reason, None where it never left (it died).
        finish_reason: why the coordinator began to finish the run (None: not known).
    """
    ends = list(learner_ends.values())
    failed = sorted(w for w, e in learner_ends.items() if e not in NORMAL_ENDS)
    # Failures beside another reason are said with it: the others carried the run to its end.
    also = f"; {len(failed)} learner(s) failed ({', '.join(failed)})" if failed else ""
    if budget and tokens_merged >= budget:
        return Stop(TOKEN_BUDGET, f"token budget reached: {tokens_merged:,} of {budget:,} merged{also}")
    if SHARE_TRAINED in ends:  # each learner trained its share of the budget; the last merge may lag
        return Stop(TOKEN_BUDGET, f"token budget trained: {tokens_merged:,} of {budget:,} merged{also}")
    if finish_reason == DATA_EXHAUSTED_REASON:  # the coordinator finished on its own
        return Stop(
            DATA_EXHAUSTED, f"data ran out at {wall_seconds:.0f} s: every shard trained, no epochs left{also}"
        )
    if FINISHING in ends:  # the coordinator was asked to finish: by the time limit or an operator
        if minutes is None:
            return Stop(FINISH_ASKED, f"asked to finish (the time limit or an operator){also}")
        if minutes > 0 and wall_seconds >= minutes * 60:
            return Stop(TIME_LIMIT, f"time limit reached: {minutes:g} min (--minutes){also}")
        return Stop(OPERATOR, f"finished by an operator at {wall_seconds:.0f} s{also}")
    if NO_MORE_DATA in ends:
        return Stop(
            DATA_EXHAUSTED, f"data ran out at {wall_seconds:.0f} s: every shard trained, no epochs left{also}"
        )
    if ends and len(failed) == len(ends):
        return Stop(LEARNERS_FAILED, f"learners failed: {', '.join(failed)}")
    return Stop(UNKNOWN, "not known: no learner said why it left")


def learner_ends(workdir: Path, learners: list[str]) -> dict[str, str | None]:
    """Each learner's last leave reason, from the coordinator's events (metrics.jsonl); None for
    one that never left. The last leave counts: under chaos a killed learner's next life leaves."""
    ends: dict[str, str | None] = dict.fromkeys(learners)
    for e in read_events(workdir / METRICS_LOG, last=KEEP_EVENTS):
        if e.get("kind") == "leave" and e.get("role") == "compute" and str(e.get("worker_id")) in ends:
            ends[str(e.get("worker_id"))] = e.get("reason") or ""  # (others: not among `learners`)
    return ends


def finish_reason(workdir: Path) -> str | None:
    """Why the coordinator began to finish the run (its ledger), or None."""
    if not ledger_path(workdir).exists():
        return None
    try:
        with read_only(workdir) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'finish_reason'").fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def quarantine_facts(quarantined: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's quarantine keys, from the quarantined chunks (`chunk`, `split` where known,
    `error`: the last failure the coordinator recorded), in chunk order.

    quarantine_reason: the first chunk's error, cut short (None: none quarantined);
    eval_chunks_quarantined: how many of them were held-out chunks (the eval loss is missing for
    them, not for want of held-out data).
    """
    first = next((q.get("error") for q in quarantined if q.get("error")), None)
    return {
        "quarantine_reason": first[:REASON_CHARS] if first else None,
        "eval_chunks_quarantined": sum(1 for q in quarantined if q.get("split") == "eval"),
    }


def quarantined_chunks(workdir: Path, fallback: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The quarantined chunks with their split, read from the ledger (the coordinator has stopped);
    `fallback` (the status detail's list, which has no split) where the ledger cannot be read."""
    if not ledger_path(workdir).exists():
        return fallback
    try:
        with read_only(workdir) as db:
            rows = db.execute("SELECT id, split, error FROM chunks WHERE state = 'quarantined' ORDER BY id")
            return [{"chunk": r[0], "split": r[1], "error": r[2]} for r in rows]
    except sqlite3.Error:
        return fallback
