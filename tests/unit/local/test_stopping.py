"""Why a run stopped and what it lost to quarantine, as summary.json and the result table say it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from diloco.coordinator.ledger import ChunkLease, Ledger, ledger_path
from diloco.coordinator.lifecycle import DATA_EXHAUSTED_REASON
from diloco.local.stopping import (
    DATA_EXHAUSTED,
    FINISH_ASKED,
    LEARNERS_FAILED,
    OPERATOR,
    TIME_LIMIT,
    TOKEN_BUDGET,
    UNKNOWN,
    learner_ends,
    quarantine_facts,
    quarantined_chunks,
    stop_reason,
)
from diloco.observe.events import METRICS_LOG
from diloco.views import print_summary
from tests.unit.coordinator.ledger_setup import TTL, complete, make


def stop(ends: dict[str, str | None], *, merged: int = 500, budget: int = 0, wall: float = 16.0,
         minutes: float | None = 0.5):  # fmt: skip
    return stop_reason(
        tokens_merged=merged, budget=budget, wall_seconds=wall, minutes=minutes, learner_ends=ends
    )


def test_the_data_running_out_is_said_before_the_time_limit() -> None:
    # The user's run: --minutes 0.5, over at 16 s, every learner out of data.
    s = stop({"learner-0": "no more data", "learner-1": "no more data"})
    assert s.code == DATA_EXHAUSTED and "data ran out at 16 s" in s.because


def test_the_token_budget_wins_over_how_learners_left() -> None:
    s = stop({"learner-0": "run finishing"}, merged=1200, budget=1000, wall=40.0)
    assert s.code == TOKEN_BUDGET and "1,200 of 1,000" in s.because
    assert stop({"learner-0": "token share trained"}, merged=990, budget=1000).code == TOKEN_BUDGET


def test_a_finish_is_the_time_limit_past_the_deadline_and_an_operator_before_it() -> None:
    ends = {"learner-0": "run finishing", "learner-1": "no more data"}
    assert stop(ends, wall=30.4).code == TIME_LIMIT
    assert stop(ends, wall=12.0).code == OPERATOR
    assert stop(ends, wall=999.0, minutes=0).code == OPERATOR  # no time limit at all
    assert stop(ends, minutes=None).code == FINISH_ASKED  # the limit not known


def test_a_coordinator_that_finished_when_its_data_ran_out_is_not_an_operators_finish() -> None:
    """The coordinator finishes on its own once every train shard is merged (lifecycle): learners
    then leave as "run finishing", which alone reads as an operator's or the time limit's."""
    ends = {"learner-0": "run finishing", "learner-1": "run finishing"}
    s = stop_reason(tokens_merged=500, budget=0, wall_seconds=12.0, minutes=0.5, learner_ends=ends,
                    finish_reason=DATA_EXHAUSTED_REASON)  # fmt: skip
    assert s.code == DATA_EXHAUSTED
    asked = stop_reason(tokens_merged=500, budget=0, wall_seconds=12.0, minutes=0.5, learner_ends=ends,
                        finish_reason="asked by supervisor: time budget reached")  # fmt: skip
    assert asked.code == OPERATOR


def test_failed_learners_are_named() -> None:
    s = stop({"learner-0": None, "learner-1": "refused: no loss"})
    assert s.code == LEARNERS_FAILED and "learner-0, learner-1" in s.because
    # One failed beside others that ran out of data: the reason is the data's, the failure said.
    s = stop({"learner-0": "no more data", "learner-1": "stopped"})
    assert s.code == DATA_EXHAUSTED and "1 learner(s) failed (learner-1)" in s.because
    assert stop({}).code == UNKNOWN


def test_learner_ends_are_the_last_leave_of_each(tmp_path: Path) -> None:
    events = [
        {"kind": "leave", "role": "compute", "worker_id": "learner-0", "reason": "stopped"},
        {"kind": "leave", "role": "data", "worker_id": "data-0", "reason": "done"},
        {"kind": "leave", "role": "compute", "worker_id": "learner-0", "reason": "no more data"},
        {"kind": "join", "role": "compute", "worker_id": "learner-2"},
        # An earlier job's learner on the same workdir (this job runs two): not this job's failure.
        {"kind": "leave", "role": "compute", "worker_id": "learner-3", "reason": "stopped"},
    ]
    (tmp_path / METRICS_LOG).write_text("".join(json.dumps(e) + "\n" for e in events))
    ends = learner_ends(tmp_path, ["learner-0", "learner-1"])
    assert ends == {"learner-0": "no more data", "learner-1": None}  # learner-1 never left
    assert learner_ends(tmp_path / "none", ["learner-0"]) == {"learner-0": None}


def test_quarantined_chunks_carry_their_split_and_last_error(tmp_path: Path) -> None:
    path = ledger_path(tmp_path)
    path.parent.mkdir()
    ledger = Ledger(str(path))
    make(ledger, ["train", "eval", "train"])
    for _ in range(3):  # every chunk leased; the eval one fails twice (quarantined), others done
        lease = ledger.lease_chunk("d1", TTL)
        assert isinstance(lease, ChunkLease)
        if lease.spec.split == "eval":
            ledger.fail_chunk("d1", lease.chunk_id, "ValueError: first", max_attempts=2)
            lease = ledger.lease_chunk("d1", TTL)
            assert isinstance(lease, ChunkLease) and lease.spec.split == "eval"
            ledger.fail_chunk("d1", lease.chunk_id, "ValueError: bad bytes\nTraceback ...", max_attempts=2)
        else:
            complete(ledger, "d1", lease.chunk_id)
    ledger.close()
    chunks = quarantined_chunks(tmp_path, fallback=[])
    assert [(c["split"], c["error"]) for c in chunks] == [("eval", "ValueError: bad bytes\nTraceback ...")]
    assert quarantine_facts(chunks) == {
        "quarantine_reason": "ValueError: bad bytes\nTraceback ...",
        "eval_chunks_quarantined": 1,
    }
    # No ledger: the status detail's list (no split), so no held-out chunk is claimed lost.
    detail = [{"chunk": 3, "error": "boom"}]
    assert quarantine_facts(quarantined_chunks(tmp_path / "none", detail)) == {
        "quarantine_reason": "boom",
        "eval_chunks_quarantined": 0,
    }
    assert quarantine_facts([]) == {"quarantine_reason": None, "eval_chunks_quarantined": 0}


SUMMARY: dict[str, Any] = {"tokens_trained": 1000, "tokens_merged": 1000, "rounds": 4, "chunks": 5, "shards": 4,
                           "wire_bytes_per_token": 8.0, "utilization": 0.9, "wall_seconds": 16.0, "audit_ok": True,
                           "eval_loss": None}  # fmt: skip


def table(extra: dict[str, Any]) -> dict[str, str]:
    console = Console(width=200, record=True)
    print_summary(console, {**SUMMARY, **extra}, Path("summary.json"))
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_the_table_says_the_held_out_data_was_quarantined() -> None:
    rows = table({"chunks_quarantined": 1, "eval_chunks_quarantined": 1,
                  "quarantine_reason": "ValueError: bad bytes\nTraceback (most recent call last): ..."})  # fmt: skip
    assert rows["eval loss"] == "- (1 held-out chunk quarantined)"
    assert rows["chunks quarantined"] == "1 (first: ValueError: bad bytes)"
    assert rows["chunks / shards"] == "5 / 4"
    # Nothing quarantined: no row, and a missing eval loss is a missing split.
    rows = table({"chunks_quarantined": 0})
    assert rows["eval loss"] == "- (no held-out data)" and "chunks quarantined" not in rows
    # Some held-out chunks left: the loss, with what it lacks.
    rows = table({"eval_loss": 2.5, "chunks_quarantined": 2, "eval_chunks_quarantined": 2})
    assert rows["eval loss"] == "2.5000 nats/token (2 held-out chunks quarantined)"
    assert rows["chunks quarantined"] == "2"


def test_the_table_says_why_the_run_stopped() -> None:
    because = "data ran out at 16 s: every shard trained, no epochs left"
    assert table({"stopped": DATA_EXHAUSTED, "stopped_because": because})["stopped"] == because
    assert "stopped" not in table({})  # a summary from before the key
