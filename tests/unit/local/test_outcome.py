"""`diloco run` refuses a workdir whose run has finished, and a job that merged nothing ends with
each failed process's cause (the last error line of its log), not a table of zeros."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger, ledger_path
from diloco.coordinator.workdir import settings_not_used
from diloco.errors import DilocoError
from diloco.local.launch import LocalRun, LocalRunOptions
from diloco.local.outcome import (
    CAUSE_WIDTH,
    RecordedRun,
    cause,
    data_workers_failed,
    failure_causes,
    finished_run_refusal,
    job_counts,
    last_error_line,
    recorded_config,
    recorded_run,
    resume_notes,
    run_failure,
    saving_failed,
)
from diloco.local.procs import Child, ProcessGroup
from diloco.views import progress_line

TRACEBACK_LOG = """2026-12-06 02:58:44,001 INFO learner[1] diloco.client: joined 127.0.0.1:4000 as learner-0
Traceback (most recent call last):
  File "/x/adamw.py", line 36, in __init__
    super().__init__(
ValueError: Invalid learning rate: -1.0
"""
LOGS = Path("/w/logs")


def test_the_cause_is_the_refusal_line_else_the_exception_else_the_last_line() -> None:
    refused = "INFO joined\nERROR diloco.learner: model.init_from: w does not fit\nerror: model.init_from: w does not fit\n"
    assert last_error_line(refused) == "model.init_from: w does not fit"
    assert last_error_line(TRACEBACK_LOG) == "ValueError: Invalid learning rate: -1.0"
    # Lines after the traceback (a shutdown's) do not hide its exception.
    assert last_error_line(TRACEBACK_LOG + "INFO leaving\n") == "ValueError: Invalid learning rate: -1.0"
    assert last_error_line("INFO started\nsomething odd happened\n\n") == "something odd happened"
    assert last_error_line("") is None
    long = last_error_line("error: " + "x" * 1000)
    assert long is not None and len(long) == CAUSE_WIDTH and long.endswith("…")


def test_a_signal_is_its_own_cause() -> None:
    assert cause(-9, "killed by SIGKILL", TRACEBACK_LOG) == "killed by SIGKILL"
    assert cause(1, "exit code 1", TRACEBACK_LOG) == "ValueError: Invalid learning rate: -1.0"
    assert cause(1, "exit code 1", "") == "exit code 1"


def test_a_job_that_merged_nothing_fails_with_each_cause_once() -> None:
    causes = {"learner-0": "ValueError: lr", "learner-1": "ValueError: lr", "data-0": "OSError: disk"}
    problem = run_failure(causes, (0, 0), 12.0, LOGS)
    assert problem is not None
    first, *lines = problem.splitlines()
    assert "merged nothing" in first and "learner-0, learner-1, data-0" in first and str(LOGS) in first
    assert lines == ["  learner-0, learner-1: ValueError: lr", "  data-0: OSError: disk"]
    # Trained but merged nothing (the learners died before their pushes merged): still failed.
    assert run_failure(causes, (5000, 0), 12.0, LOGS) is not None


def test_a_job_that_merged_is_not_failed_and_one_that_never_stepped_is() -> None:
    assert run_failure({"learner-1": "killed by SIGKILL"}, (5000, 4000), 12.0, LOGS) is None
    assert run_failure({}, (5000, 0), 12.0, LOGS) is None  # trained, merged nothing yet: a short run
    problem = run_failure({}, (0, 0), 12.0, LOGS)
    assert problem is not None and "no learner trained a step in 12 s" in problem


def test_a_job_whose_chunks_were_all_quarantined_says_the_first_ones_error() -> None:
    """A preprocess that breaks its contract fails every chunk and no process: the recorded error
    is the cause, not "the time budget ended first"."""
    error = "PreprocessError: data.preprocess mypkg.bad:strings: column 'name' is <U5\nmore"
    problem = run_failure({}, (0, 0), 6.0, LOGS, quarantine=(18, error))
    assert problem is not None
    assert "18 chunks quarantined" in problem and "column 'name' is <U5" in problem
    assert "more" not in problem and "time budget" not in problem
    assert run_failure({}, (0, 0), 6.0, LOGS, quarantine=(1, None)).startswith(  # type: ignore[union-attr]
        "the run merged nothing: 1 chunk quarantined"
    )
    # Some chunks quarantined in a run that trained: the summary's row says it, not a failure.
    assert run_failure({}, (5000, 0), 6.0, LOGS, quarantine=(2, error)) is None


def test_a_job_ends_when_every_data_worker_failed_with_chunks_left() -> None:
    left = {"chunks_total": 18, "chunks_done": 0, "chunks_quarantined": 0}
    assert data_workers_failed([2, 2], left)
    assert not data_workers_failed([2, None], left)  # one still working
    assert not data_workers_failed([2, -9], left)  # killed (chaos respawns it): not its own failure
    assert not data_workers_failed([0, 0], {"chunks_total": 18, "chunks_done": 18})  # done
    assert not data_workers_failed([2, 2], {"chunks_total": 18, "chunks_done": 16, "chunks_quarantined": 2})
    assert not data_workers_failed([], left)


def test_a_resumed_run_counts_only_this_jobs_tokens() -> None:
    detail = {"tokens_trained": 9000, "tokens_merged": 8000}
    assert job_counts(detail, None) == (9000, 8000)
    assert job_counts(detail, RecordedRun("running", 9000, 8000)) == (0, 0)
    assert job_counts(detail, RecordedRun("running", 4000, 3000)) == (5000, 5000)


def ledger_with(workdir: Path, state: str | None, merged: int) -> None:
    ledger_path(workdir).parent.mkdir(parents=True)
    ledger = Ledger(str(ledger_path(workdir)))
    try:
        if state:
            ledger.set_meta(run_state=state)
        ledger.bump("tokens_merged", merged)
    finally:
        ledger.close()


def test_the_workdirs_run_is_read_from_its_ledger(tmp_path: Path) -> None:
    assert recorded_run(tmp_path / "new") is None
    ledger_with(tmp_path / "started", None, 0)  # a coordinator that never changed its state
    assert recorded_run(tmp_path / "started") == RecordedRun("running", 0, 0)
    ledger_with(tmp_path / "done", "finished", 1234)
    assert recorded_run(tmp_path / "done") == RecordedRun("finished", 0, 1234)


def test_only_a_finished_run_is_refused(tmp_path: Path) -> None:
    for state in ("running", "finishing"):  # resumed: a kill -9 in either is survived
        assert finished_run_refusal(RecordedRun(state, 10, 10), tmp_path) is None
    assert finished_run_refusal(None, tmp_path) is None
    refusal = finished_run_refusal(RecordedRun("finished", 10, 1234), tmp_path)
    assert refusal is not None and "finished run (1,234 tokens merged)" in refusal and "--workdir" in refusal
    assert "init_from" not in refusal  # no summary, no model to name
    (tmp_path / "summary.json").write_text(json.dumps({"model": str(tmp_path / "model.safetensors")}))
    refusal = finished_run_refusal(RecordedRun("finished", 10, 1234), tmp_path)
    assert refusal is not None and f"model.init_from={tmp_path / 'model.safetensors'}" in refusal


def test_a_job_on_a_finished_runs_workdir_starts_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    ledger_with(workdir, "finished", 1234)
    job = LocalRun(LocalRunOptions(workdir=str(workdir), show_progress=False, tls=False))
    with pytest.raises(DilocoError, match="holds a finished run"):
        job.run()
    assert not job.group.children and not (workdir / "logs").exists()


def ended(tmp_path: Path, name: str, role: str, code: str) -> Child:
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    proc.wait(timeout=60)
    return Child(name, role, [], proc, log_path)


def test_the_failed_learners_and_data_workers_are_named_with_their_causes(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    group.children = [
        ended(tmp_path, "learner-0", "learner", "raise ValueError('Invalid learning rate: -1.0')"),
        ended(tmp_path, "learner-1", "learner", "print('trained')"),
        ended(tmp_path, "data-0", "data", "import sys; print('error: cannot read x'); sys.exit(2)"),
        ended(tmp_path, "evaluator", "evaluator", "raise SystemExit(1)"),  # not the job's work
    ]
    assert failure_causes(group) == {
        "learner-0": "ValueError: Invalid learning rate: -1.0",
        "data-0": "cannot read x",
    }


def test_a_resume_says_what_the_run_did_and_which_settings_it_does_not_take(tmp_path: Path) -> None:
    """A restart keeps the run's first settings (the coordinator's ledger): one given now that
    differs is named, not dropped in silence, and the summary's config is the run's."""
    started = RunConfig().with_overrides({"train.lr": 0.001, "data.deal": 2, "model.vocab_size": 257})
    ledger_with(tmp_path, None, 722_400)
    ledger = Ledger(str(ledger_path(tmp_path)))
    try:
        ledger.set_meta(config=started.to_json())
        ledger.bump("tokens_trained", 800_000)
    finally:
        ledger.close()
    before = recorded_run(tmp_path)
    assert recorded_config(tmp_path) == started
    given = RunConfig().with_overrides({"train.lr": 0.01, "data.deal": 3, "name": "run-2"})
    assert settings_not_used(given, started) == [
        "data.deal = 3 (the run's: 2)",
        "train.lr = 0.01 (the run's: 0.001)",
    ]  # vocab_size 0 ("the tokenizer's") and the job's name are no difference
    first, warning = resume_notes(before, tmp_path, given)
    assert "722,400 tokens merged (800,000 trained) before this job" in first
    assert "not used: data.deal = 3 (the run's: 2); train.lr = 0.01" in warning
    assert resume_notes(before, tmp_path, started) == [first]
    assert resume_notes(None, tmp_path / "new", given) == []


def test_a_job_stops_when_its_merges_cannot_be_saved() -> None:
    """A full disk: the coordinator fails every publish and retries; the job went on training work
    it never kept, past --minutes, and said nothing. After a minute of it, it stops with the cause."""
    workdir = Path("/runs/r5")
    assert saving_failed({}, workdir) is None
    assert saving_failed({"publish_failing": None}, workdir) is None
    short = {"publish_failing": {"seconds": 12.0, "error": "[Errno 28] No space left on device"}}
    assert saving_failed(short, workdir) is None  # a store hiccup passes
    long = {"publish_failing": {"seconds": 61.0, "error": "[Errno 28] No space left on device"}}
    problem = saving_failed(long, workdir) or ""
    assert "has not saved a merge for 61 s: [Errno 28] No space left on device" in problem
    assert "/runs/r5 is kept up to its last saved merge" in problem
    assert "SAVING MERGES FAILING for 61 s" in progress_line(long, 0.0)
