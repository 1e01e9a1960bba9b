"""Whether a local job has work to do, and whether it did it: `diloco run` refuses a workdir whose
run has finished before it starts anything, and a job that merged nothing ends with each failed
process's cause instead of a table of zeros. Light on imports (no torch): read before the job
starts and after it ends."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from diloco.config import RunConfig
from diloco.coordinator.ledger import ledger_path
from diloco.coordinator.lifecycle import FINISHED, RUNNING
from diloco.coordinator.report import read_only, stored_run, tokens_reported
from diloco.coordinator.wirecount import WIRE_COUNTS, job_wire_bytes
from diloco.coordinator.workdir import resumed_config, settings_not_used
from diloco.errors import DilocoError
from diloco.local.procs import ProcessGroup
from diloco.local.stopping import quarantine_facts, quarantined_chunks

# A cause is one line of the report: long enough for a model.init_from mismatch's first names.
CAUSE_WIDTH = 240
TRACEBACK = "Traceback (most recent call last):"


@dataclass(frozen=True)
class RecordedRun:
    """What a workdir's ledger holds of its run: its state (lifecycle's) and its durable counts."""

    state: str
    tokens_trained: int
    tokens_merged: int
    tokens_prepared: int = 0
    tokens_pushed: int = 0  # the ledger's count of tokens its pushes carried
    wire_bytes: int = 0  # the job's own (monitoring left out), every coordinator life's
    wire_join_bytes: int = 0  # of them, learners' joins (init and first pulls)


def recorded_run(workdir: Path) -> RecordedRun | None:
    """The run in a workdir, read from its ledger without starting a coordinator; None: none yet."""
    path = ledger_path(workdir)
    if not path.exists():
        return None
    with read_only(workdir) as db:  # a query, not a Ledger: opening one may migrate an old ledger
        meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('run_state', ?)", (WIRE_COUNTS,)))
        counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
        prepared = db.execute("SELECT COALESCE(SUM(tokens), 0) FROM shards").fetchone()[0]
        stats = [r[0] for r in db.execute("SELECT stats FROM workers WHERE role = 'compute'")]
    # Trained as the coordinator's status counts it (its pushed count, or the learners' own
    # counts with earlier lives' when larger): a resumed job's figures subtract the same measure.
    reported = tokens_reported(counters.get("tokens_trained_by_earlier_lives", 0), stats)
    return RecordedRun(
        meta.get("run_state") or RUNNING,
        max(int(counters.get("tokens_trained", 0)), reported),
        int(counters.get("tokens_merged", 0)),
        int(prepared),
        int(counters.get("tokens_trained", 0)),
        *job_wire_bytes(json.loads(meta.get(WIRE_COUNTS) or "{}")),
    )


def recorded_config(workdir: Path) -> RunConfig | None:
    """The settings the workdir's run started with (they win on a resume); None: no run there."""
    try:
        return RunConfig.from_json(stored_run(workdir)[0])
    except FileNotFoundError:
        return None


def resume_notes(before: RecordedRun | None, workdir: Path, config: RunConfig) -> list[str]:
    """What a job that resumes a run says at its start: what the run had done, and the settings
    given now that the run does not take (its first start's win, in the coordinator too)."""
    recorded = recorded_config(workdir) if before is not None else None
    if before is None or recorded is None:
        return []
    unit = recorded.data.unit
    notes = [
        f"resuming the run in {workdir}: {before.tokens_merged:,} {unit} merged ({before.tokens_trained:,} "
        "trained) before this job; the rates at the end are this job's own"
    ]
    recorded, taken = resumed_config(config, recorded)
    if taken:
        notes.append("at this restart: " + escape("; ".join(taken)))
    if differ := settings_not_used(config, recorded):
        notes.append(
            "[yellow]warning:[/] the run keeps the settings it started with; not used: "
            + escape("; ".join(differ))
            + " (a new --workdir starts a run with them)"
        )
    return notes


def finished_run_refusal(run: RecordedRun | None, workdir: Path) -> str | None:
    """Why this workdir cannot take a job, or None. A finished run stays finished (lifecycle): a job
    started on it would train nothing and report a table of zeros. An unfinished one is resumed."""
    if run is None or run.state != FINISHED:
        return None
    model = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no summary: finished by hand
        model = json.loads((workdir / "summary.json").read_text()).get("model")
    then = f" to train again, or start one from its model: --set model.init_from={model}" if model else ""
    return (
        f"{workdir} holds a finished run ({run.tokens_merged:,} tokens merged): nothing is left to train "
        f"there; give a new --workdir{then}"
    )


def shorten(line: str, width: int = CAUSE_WIDTH) -> str:
    line = line.strip()
    return line if len(line) <= width else line[: width - 1] + "…"


def last_error_line(log_tail: str) -> str | None:
    """The cause a failed process's log ends with: its own `error:` line when it refused (the CLI's
    clear errors), else its last traceback's exception line, else its last line; None: empty."""
    lines = [line for line in log_tail.splitlines() if line.strip()]
    refusals = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if refusals:
        return shorten(refusals[-1])
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if starts:  # the exception is the first line after the last traceback's indented frames
        exception = next((line for line in lines[starts[-1] + 1 :] if not line[0].isspace()), None)
        if exception:
            return shorten(exception)
    return shorten(lines[-1]) if lines else None


def cause(returncode: int | None, how_it_ended: str, log_tail: str) -> str:
    """One failed process's cause: a signal says it (its log stops mid-line), else its log."""
    if returncode is not None and returncode < 0:
        return how_it_ended
    return last_error_line(log_tail) or how_it_ended


def cause_lines(causes: dict[str, str]) -> list[str]:
    """One line per distinct cause, naming the processes it stopped (every learner refusing the
    same setting is one line)."""
    by_cause: dict[str, list[str]] = {}
    for name, why in causes.items():
        by_cause.setdefault(why, []).append(name)
    return [f"  {', '.join(names)}: {why}" for why, names in by_cause.items()]


def failure_causes(group: ProcessGroup) -> dict[str, str]:
    """The job's learners and data workers that failed, each with its cause. Read before the job
    stops them: ended by its SIGTERM is no failure."""
    ended = [c for c in [*group.by_role("learner"), *group.by_role("data")] if not c.alive]
    return {
        c.name: cause(c.proc.returncode, c.how_it_ended(), group.tail(c, lines=200))
        for c in ended
        if c.proc.returncode != 0
    }


def data_workers_failed(exit_codes: list[int | None], detail: dict[str, Any]) -> bool:
    """Every data worker exited with an error of its own (not a signal: chaos respawns those)
    while chunks were left to prepare: no more data will come, and learners would wait for it
    until the time limit (a `data.preprocess` that does not import ends every data worker at join)."""
    if not exit_codes or any(code is None or code <= 0 for code in exit_codes):
        return False
    settled = int(detail.get("chunks_done", 0)) + int(detail.get("chunks_quarantined", 0))
    return settled < int(detail.get("chunks_total", 0)) or not detail


# How long merges may fail to be saved before a job stops: a store hiccup passes in seconds; a full
# disk does not, and the run would go on training work that is never kept.
SAVING_STALL_S = 60.0


def saving_failed(detail: dict[str, Any], workdir: Path, limit_s: float = SAVING_STALL_S) -> str | None:
    """Why the job stops, or None: the coordinator has not saved a merge for `limit_s` (its
    status's publish_failing: for how long, the store's error)."""
    failing = detail.get("publish_failing")
    if not failing or failing.get("seconds", 0.0) < limit_s:
        return None
    return (
        f"the coordinator has not saved a merge for {failing['seconds']:.0f} s: {failing.get('error')}; "
        f"the run in {workdir} is kept up to its last saved merge: fix the store (free space) and run "
        "the same command to resume it"
    )


def job_counts(detail: dict[str, Any], before: RecordedRun | None) -> tuple[int, int]:
    """Tokens trained and merged by this job, from the coordinator's final status: a resumed run's
    counts hold its earlier lives' too."""
    trained, merged = int(detail.get("tokens_trained", 0)), int(detail.get("tokens_merged", 0))
    if before is None:
        return trained, merged
    return max(0, trained - before.tokens_trained), max(0, merged - before.tokens_merged)


def run_failure(
    causes: dict[str, str],
    counts: tuple[int, int],
    seconds: float,
    logs: Path,
    quarantine: tuple[int, str | None] = (0, None),
) -> str | None:
    """Why the job did not do its work, or None: it merged nothing (`counts`: this job's tokens
    trained and merged). `causes`: the processes that failed, each with its cause; `quarantine`:
    the chunks quarantined and the first one's recorded error (a preprocess that breaks its
    contract fails every chunk, and no process fails)."""
    trained, merged = counts
    if merged > 0:
        return None
    quarantined, reason = quarantine
    if quarantined and trained == 0:
        first = f": {shorten(reason.strip().splitlines()[0])}" if reason and reason.strip() else ""
        said = f"the run merged nothing: {quarantined} chunk{'s' if quarantined != 1 else ''} quarantined"
        return "\n".join([f"{said} (logs in {logs}); the first one's error{first}", *cause_lines(causes)])
    if causes:
        return "\n".join(
            [f"the run merged nothing: {', '.join(causes)} failed (logs in {logs})", *cause_lines(causes)]
        )
    if trained == 0:
        return (
            f"no learner trained a step in {seconds:.0f} s (logs in {logs}): the time budget ended "
            "first (--minutes), or there was no data left to train on"
        )
    return None


def job_outcome(
    causes: dict[str, str], detail: dict[str, Any], before: RecordedRun | None, seconds: float, workdir: Path
) -> str:
    """After the job: raises its run_failure (it merged nothing), else the warning naming the
    processes that failed ("" when none did)."""
    quarantined = quarantine_facts(quarantined_chunks(workdir, detail.get("quarantined") or []))
    quarantine = (int(detail.get("chunks_quarantined", 0)), quarantined["quarantine_reason"])
    if problem := run_failure(causes, job_counts(detail, before), seconds, workdir / "logs", quarantine):
        raise DilocoError(problem)
    if not causes:
        return ""
    lines = escape("\n".join(cause_lines(causes)))  # a cause may hold [brackets]
    return f"[yellow]warning:[/] processes that failed (logs in {workdir / 'logs'}):\n{lines}"
