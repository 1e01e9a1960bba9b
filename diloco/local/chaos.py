"""Chaos: kill random processes of a local job with SIGKILL, and restart them as a supervisor would.

The choices (ChaosPlan) are pure functions of a seeded RNG, so a chaos run is repeatable for its
seed. Roles come out of a shuffled bag: every cycle of kills hits each role that has a live process
once, in random order, so a short run still kills the coordinator, not only the many workers.
ChaosMonkey carries a plan out on a job's ProcessGroup (`diloco run --chaos-interval`).
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.local.procs import ProcessGroup

# The roles chaos kills unless told: the job's own (not the evaluator, which only watches).
CHAOS_ROLES = ("coordinator", "data", "learner")
# Every role --chaos-roles may name.
KILLABLE_ROLES = (*CHAOS_ROLES, "evaluator")
# Warm spares per restarted role: two, so a second kill within a spare's warm-up (a few seconds
# of imports) still finds one ready.
SPARES_PER_ROLE = 2


@dataclass
class ChaosPlan:
    interval_s: float  # mean time between kills (exponentially distributed)
    seed: int = 0
    # The roles that may be killed (empty: all); one role at a time isolates its failure mode.
    roles: tuple[str, ...] = ()
    rng: random.Random = field(init=False)
    _bag: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:  # expovariate of a negative mean gives negative delays
            raise ValueError(f"chaos interval must be > 0 s, got {self.interval_s}")
        if unknown := set(self.roles) - set(KILLABLE_ROLES):
            raise ValueError(f"chaos roles: unknown {', '.join(sorted(unknown))}")
        self.rng = random.Random(self.seed)

    def next_delay(self) -> float:
        """Seconds until the next kill: exponential with the configured mean, at least 0.5 s."""
        return max(0.5, self.rng.expovariate(1.0 / self.interval_s))

    def pick_role(self, roles_alive: Sequence[str]) -> str | None:
        """The role to hit next, from a shuffled bag refilled with the roles that have live processes."""
        alive = sorted(r for r in set(roles_alive) if not self.roles or r in self.roles)
        self._bag = [r for r in self._bag if r in alive]
        if not self._bag:
            self._bag = alive[:]
            self.rng.shuffle(self._bag)
        return self._bag.pop() if self._bag else None

    def pick(self, names: Sequence[str]) -> str:
        return self.rng.choice(sorted(names))


@dataclass
class ChaosMonkey:
    """SIGKILLs one random live process of `group` at the plan's times and restarts it at once."""

    plan: ChaosPlan
    group: ProcessGroup
    say: Callable[[str], Any] = print
    spare_learners: bool = True  # False when a learner is a torchrun group: a spare is one process
    kills: dict[str, int] = field(default_factory=dict)  # by role
    kill_log: list[dict[str, Any]] = field(default_factory=list)  # wall clock, process, role
    next_kill: float = math.inf
    spares_kept: bool = False
    clock: Callable[[], float] = time.monotonic  # the watch loop's (a kill and restart take time)

    def start(self, now: float) -> None:
        self.next_kill = now + self.plan.next_delay()

    def tick(self, now: float, *, training: bool, finishing: bool) -> None:
        """Called by the job's watch loop: keeps spares once the learners train (or at the first
        kill, if sooner: six processes importing torch beside the job's own would slow its start
        on a small machine), and kills when a kill is due, unless the job is finishing."""
        if not self.spares_kept and (training or now >= self.next_kill):
            roles = [r for r in self.plan.roles or CHAOS_ROLES if self.spare_learners or r != "learner"]
            # A warm spare skips the interpreter's start and the imports (diloco.local.spare).
            self.group.keep_spares(roles, per_role=SPARES_PER_ROLE)
            self.spares_kept = True
        if not finishing and now >= self.next_kill:
            self.kill_one()
            self.next_kill = self.clock() + self.plan.next_delay()

    def kill_one(self) -> None:
        alive = [c for c in self.group.children if c.alive]
        role = self.plan.pick_role([c.role for c in alive])
        if role is None:
            return
        name = self.plan.pick([c.name for c in alive if c.role == role])
        victim = next(c for c in alive if c.name == name)
        self.group.signal(victim, signal.SIGKILL)
        self.kill_log.append({"at": round(time.time(), 3), "process": victim.name, "role": role})
        self.group.wait([victim], timeout_s=10)  # reaped by wait4, so its CPU time is counted
        self.kills[role] = self.kills.get(role, 0) + 1
        self.group.respawn(victim)
        self.say(f"chaos: killed {victim.name} (kill #{sum(self.kills.values())}), restarted it")
