"""A warm spare: a process that has paid its start-up costs and waits to be told who to be.

A killed learner's replacement spends most of its restart importing: torch (seconds on a loaded
machine), the library, and torch._dynamo, which the first optimizer built imports (about as long
again). A supervisor that keeps one spare per role hands the dead process's role to a process that
is already past all of that (`ProcessGroup.respawn`), so a restart costs the join, the pull and the
first batch. The spare reads one JSON line from stdin, points its stdout and stderr at the role's
log, and runs the command line it was given in this same, warm interpreter.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import IO

from diloco.compute.startup import MAIN_AT_ENV


@dataclass(frozen=True)
class Assignment:
    """What a spare becomes: the CLI arguments, the log its output goes to, extra environment."""

    args: list[str]
    log_path: str
    env: dict[str, str]

    def to_line(self) -> bytes:
        return (json.dumps({"args": self.args, "log_path": self.log_path, "env": self.env}) + "\n").encode()

    @classmethod
    def from_line(cls, line: str) -> Assignment:
        raw = json.loads(line)
        return cls(
            [str(a) for a in raw["args"]],
            str(raw["log_path"]),
            {str(k): str(v) for k, v in raw["env"].items()},
        )


def warm_up(role: str) -> None:
    """Import what `role` will import, and build an optimizer once (it imports torch._dynamo)."""
    import torch

    if role == "learner":
        import diloco.compute.learner  # noqa: F401

        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    elif role == "coordinator":
        import diloco.coordinator.server  # noqa: F401
    elif role == "data":
        import diloco.data.worker  # noqa: F401


def await_assignment(stream: IO[str]) -> Assignment | None:
    """Block until the supervisor names a role; None when it closed the pipe (it is stopping)."""
    line = stream.readline()
    return Assignment.from_line(line) if line.strip() else None


def take_over(assignment: Assignment) -> None:
    """Become the assigned process: its log on stdout and stderr, its environment, its clock."""
    fd = os.open(assignment.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(assignment.env)
    sys.argv = [sys.argv[0], *assignment.args]  # as `python -m cli ARGS` has it (compute --nproc reads it)
    os.environ[MAIN_AT_ENV] = repr(time.time())  # nothing was left to start: process start ends now


def run_assignment(assignment: Assignment) -> None:
    """Become the assigned process and run its command line in this interpreter; the CLI ends it
    with SystemExit, as `python -m cli` would (a warm spare, and a fork of the fork server)."""
    take_over(assignment)
    from cli.main import app

    app(args=assignment.args, prog_name="diloco")
    raise SystemExit(0)
