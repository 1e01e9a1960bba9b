"""Chaos: kill random processes of a local job with SIGKILL, and restart them as a supervisor would.

The choices are pure functions of a seeded RNG, so a chaos run is repeatable for its seed. Roles
come out of a shuffled bag: every cycle of kills hits each role that has a live process once, in
random order, so a short run still kills the coordinator, not only the many workers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ChaosPlan:
    interval_s: float  # mean time between kills (exponentially distributed)
    seed: int = 0
    # The roles that may be killed (empty: all); one role at a time isolates its failure mode.
    roles: tuple[str, ...] = ()
    rng: random.Random = field(init=False)
    _bag: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
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
