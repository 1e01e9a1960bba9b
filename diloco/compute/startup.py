"""Where a learner's start-up goes, from its spawn to its first inner step.

A kill costs the restart as well as the unmerged work: process start, imports, join, the pull of
every fragment, the first batch. Each is timed (wall clock, so the spawn time a supervisor passes
in DILOCO_SPAWNED_AT lines up with this process's marks) and logged in one line at the first step,
so the time lost per kill can be broken down from the learners' logs (benchmarks/goodput.py).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime

# Set by a supervisor when it spawns the process (diloco.local.procs), and by `python -m cli` as its
# first statement: the two ends of "process start" (the interpreter coming up).
SPAWNED_AT_ENV = "DILOCO_SPAWNED_AT"
MAIN_AT_ENV = "DILOCO_MAIN_AT"
PHASES = ("process", "imports", "join", "model", "pull", "first_batch", "first_step")


@dataclass
class StartupClock:
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> StartupClock:
        clock = cls()
        for name, env in (("spawned", SPAWNED_AT_ENV), ("main", MAIN_AT_ENV)):
            if value := os.environ.get(env):
                clock.marks[name] = float(value)
        return clock

    def mark(self, name: str) -> None:
        """Record the end of a phase (imports, join, model, pull, first_batch, first_step), once."""
        self.marks.setdefault(name, time.time())


def breakdown(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase, from whichever marks are there: process = spawn → `python -m cli`,
    imports = → the learner object, then each phase from the end of the one before."""
    order = ["spawned", "main", "imports", "join", "model", "pull", "first_batch", "first_step"]
    have = [name for name in order if name in marks]
    out: dict[str, float] = {}
    for before, after in zip(have, have[1:], strict=False):
        out["process" if after == "main" else after] = round(max(0.0, marks[after] - marks[before]), 3)
    if len(have) >= 2:
        out["total"] = round(marks[have[-1]] - marks[have[0]], 3)
    return out


def describe(phases: dict[str, float]) -> str:
    parts = [f"{name.replace('_', ' ')} {phases[name]:.2f}s" for name in PHASES if name in phases]
    return f"start-up: {', '.join(parts)} (total {phases.get('total', 0.0):.2f}s)"


# The line `describe` makes, as diloco.logs writes it: "<date> <time,ms> INFO learner[pid] ...".
_LINE = re.compile(r"^(\S+ \S+) .*start-up: (.*) \(total ([\d.]+)s\)")


@dataclass(frozen=True)
class Startup:
    """One process life's start-up, read back from its log."""

    first_step_at: float  # wall clock (time.time()) of the first inner step
    phases: dict[str, float]  # PHASES and "total", in seconds


def read_startups(log_text: str) -> list[Startup]:
    """Every start-up line in a learner's log, in order (one per life)."""
    out = []
    for line in log_text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        phases = {}
        for part in match.group(2).split(", "):
            name, seconds = part.rsplit(" ", 1)
            phases[name.replace(" ", "_")] = float(seconds.rstrip("s"))
        phases["total"] = float(match.group(3))
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append(Startup(at, phases))
    return out
