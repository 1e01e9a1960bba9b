"""What every mode's process of the simulator writes to and reads: the books (where the chip-time
went) and the run's context (its config and the sync costs worked out once). Kept apart from the
engine, which runs the modes, so that the modes import these without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.simulate.config import SimConfig
from diloco.simulate.costs import SyncTimes, sync_times
from diloco.simulate.rules import KeptState


@dataclass
class Timeline:
    """How long at least one program stepped: the count of stepping programs over time."""

    stepping: int = 0
    since: float = 0.0
    total: float = 0.0

    def set(self, now: float, stepping: int) -> None:
        if self.stepping > 0:
            self.total += now - self.since
        self.stepping, self.since = stepping, now


@dataclass
class Books:
    """Chip-seconds by where they went, and the run's counters."""

    allocated: float
    useful: float = 0.0
    wasted: float = 0.0
    failures: int = 0
    restarts: int = 0
    halted_s: float = 0.0
    uptime: Timeline = field(default_factory=Timeline)
    reasons: dict[str, int] = field(default_factory=dict)

    def count(self, reason: str) -> None:
        """Tally a decision by its action word (the reason's detail varies)."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


@dataclass(frozen=True)
class Context:
    """What every mode's process needs, computed once per run."""

    cfg: SimConfig
    sync: SyncTimes
    end_s: float  # when stepping stops (the horizon less the wind-down)
    kept: KeptState


def context(cfg: SimConfig) -> Context:
    cfg.check()
    sync = sync_times(cfg.link, cfg.outer, cfg.step_s)
    kept = KeptState(
        step_s=cfg.step_s / cfg.step_efficiency,
        state_every_s=cfg.recovery.state_every_s,
        state_lag_s=cfg.recovery.state_lag_s,
        state_survives=cfg.recovery.state_survives,
        push_interval_s=sync.push_interval_s / cfg.step_efficiency,
        fragments=cfg.outer.fragments,
        push_s=sync.push_s,
    )
    return Context(cfg, sync, max(0.0, cfg.horizon_s - cfg.wind_down_s), kept)
