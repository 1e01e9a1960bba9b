"""`diloco status --watch`: a refresh loop that waits out a coordinator that does not answer, from
its first refresh on, and stops once the run it watched has finished and its coordinator is gone."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from diloco.errors import DilocoError

# What a watch does when a refresh gets no answer.
WAIT, STOP, REFUSE = "wait", "stop", "refuse"


@dataclass(frozen=True)
class Outage:
    """A refresh without an answer, decided: WAIT (show `line`, ask again), STOP (show `line`, end
    the watch: exit 0), or REFUSE (`line` is the error: waiting would not change it)."""

    action: str
    line: str


def unreachable_line(since: float, now: float, cause: str) -> str:
    """What a watch shows while the coordinator does not answer: since when (wall clock), for how
    long, and gRPC's last word on it ("Connection refused")."""
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    return f"coordinator unreachable since {clock} ({max(0.0, now - since):.0f} s): {cause}"


def on_outage(
    last_state: str | None,
    down_since: float,
    now: float,
    cause: str,
    *,
    ended: str | None = None,
    problem: str = "",
    problem_since: float | None = None,
) -> Outage:
    """What to do about a coordinator that did not answer (pure: the facts in, the decision out).

    `last_state`: the run state of the last picture shown (None: none yet); `down_since`: when the
    outage began; `cause`: gRPC's last word; `ended`: why the job's workdir says it has ended (None:
    it does not say, or there is no workdir); `problem`: a handshake's failure (the two ends'
    security does not match), failing since `problem_since`.
    - the last picture was a finished run: its coordinator has exited, as a finished run's does;
    - the workdir says the job ended: nothing will answer again;
    - no picture yet, and every try is refused by the handshake for HANDSHAKE_PATIENCE_S: refused
      (a wrong identity does not change by waiting);
    - else wait (a coordinator restarting, not started yet, or stopped for a while)."""
    from diloco.security.transport import HANDSHAKE_PATIENCE_S

    if last_state == "finished":
        return Outage(STOP, f"run finished; its coordinator has exited ({cause})")
    if ended:
        return Outage(STOP, ended)
    if (
        last_state is None
        and problem
        and problem_since is not None
        and now - problem_since >= HANDSHAKE_PATIENCE_S
    ):
        return Outage(REFUSE, f"cannot connect to the coordinator: {problem}")
    return Outage(WAIT, unreachable_line(down_since, now, cause))


def job_ended(workdir: Path) -> str | None:
    """Why a `diloco run` job's workdir says the job has ended (None: it does not say so). Nobody
    holds the workdir (no coordinator runs there) and either its ledger says the run finished (a
    finished run stays finished) or its summary.json was written after this coordinator started
    (the job wrote its results). A coordinator that is being restarted holds it again soon, and
    its run is not finished: that is waited for."""
    from diloco.coordinator.workdir import workdir_holder

    info, summary = workdir / "coordinator.json", workdir / "summary.json"
    if not info.exists() or workdir_holder(str(workdir)) is not None:
        return None
    results = " (its results: summary.json)" if summary.exists() else ""
    line = f"{workdir}'s coordinator is not running: the job has ended{results}"
    if _ledger_run_state(workdir) == "finished":
        return line
    try:
        return line if summary.stat().st_mtime >= info.stat().st_mtime else None
    except OSError:
        return None


def _ledger_run_state(workdir: Path) -> str | None:
    from diloco.coordinator.ledger.db import ledger_path
    from diloco.coordinator.report import read_only

    if not ledger_path(workdir).exists():
        return None
    try:
        with read_only(workdir) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'run_state'").fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else str(row[0])


def watch_status(
    fetch: Callable[[], dict[str, Any]],
    show: Callable[[dict[str, Any] | None, str | None], None],
    every_s: float,
    *,
    now: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    refreshes: int | None = None,
    ended: Callable[[], str | None] = lambda: None,
    handshake: Callable[[str], str] = lambda details: "",
) -> None:
    """`diloco status --watch`: fetch() every `every_s` and show(detail, None); a coordinator that
    does not answer (restarting, a network cut, not answering yet: the retryable codes workers
    wait out too), from the first refresh on, is waited for, shown as show(None, line) counted from
    its first failed refresh, until it answers again (on_outage decides; `ended()`: why the job's
    workdir says it ended; `handshake(details)`: a security mismatch in gRPC's words). Any other
    refusal (a wrong identity) ends the watch: it would not change by waiting. Runs until Ctrl-C,
    until the finished run's coordinator is gone (returns), or `refreshes` shows (tests)."""
    from diloco.client import RETRYABLE
    from diloco.security.transport import connect_cause

    down_since: float | None = None
    problem_since: float | None = None
    last_state: str | None = None
    shown = 0
    while refreshes is None or shown < refreshes:
        if shown:
            sleep(every_s)
        try:
            detail = fetch()
        except grpc.RpcError as e:
            # CANCELLED too: a coordinator that stops cancels the calls it was serving (measured:
            # a refresh in flight as the coordinator stopped ended the watch, exit 2).
            if e.code() not in RETRYABLE and e.code() != grpc.StatusCode.CANCELLED:
                raise
            at = now()
            down_since = at if down_since is None else down_since
            details = e.details() or ""
            problem = handshake(details)
            problem_since = (at if problem_since is None else problem_since) if problem else None
            outage = on_outage(
                last_state, down_since, at, connect_cause(details) or e.code().name,
                ended=ended(), problem=problem, problem_since=problem_since,
            )  # fmt: skip
            if outage.action == REFUSE:
                raise DilocoError(outage.line) from None
            show(None, outage.line)
            if outage.action == STOP:
                return
        else:
            down_since = problem_since = None
            last_state = str(detail.get("run_state", "")) or None
            show(detail, None)
        shown += 1


def json_lines(write: Callable[[str], None]) -> Callable[[dict[str, Any] | None, str | None], None]:
    """A `show` for watch_status that streams JSON lines (`diloco status --watch N --json`): one
    object per refresh, the status detail, or {"unreachable": line} while the coordinator does
    not answer (`write` should flush, for a pipe: `| jq`)."""

    def show(detail: dict[str, Any] | None, unreachable: str | None) -> None:
        write(json.dumps(detail if detail is not None else {"unreachable": unreachable}) + "\n")

    return show
