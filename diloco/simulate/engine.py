"""The discrete-event engine: a simpy clock, the books, and one process per mode.

A run is one job over cfg.hours: its failures are drawn up front (diloco.simulate.failures), a
simpy process per mode walks them in time order and asks diloco.simulate.rules what each one
does, and the books add up where the chip-time went. Programs are simulated at the granularity
of learners (or the whole job) and of failures and syncs, never of single steps: the work done
between two events is the elapsed stepping time, times the chips, times their pace.

Outputs, per run:
- goodput: useful chip-time over allocated chip-time (chips x wall), where useful is stepping
  whose work counts in the model (merged, or in a kept state), in units of nominal steps;
- uptime: the share of wall time in which at least one program (learner, or the job) steps;
- wasted: chip-time that computed work a failure then threw away, over allocated chip-time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from diloco.simulate.books import Books, context
from diloco.simulate.config import SimConfig

MODES = ("dp", "elastic-dp", "sync-diloco", "decoupled")


def need_simpy() -> Any:
    """simpy, or one clear line saying how to get it."""
    try:
        import simpy
    except ImportError:
        raise ImportError("the simulator needs simpy: pip install 'diloco[simulate]'") from None
    return simpy


@dataclass(frozen=True)
class Result:
    """One simulated run of one mode."""

    mode: str
    chips: int
    learners: int
    hours: float
    goodput: float
    uptime: float
    wasted: float
    failures: int
    merge_halted: float  # share of wall time the syncer could not merge (Decoupled)
    effective_h: float  # H after the link's stretch (DiLoCo modes)
    sync: dict[str, float]
    decisions: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulate(cfg: SimConfig, mode: str) -> Result:
    """Run one mode of one job; the same cfg (seed included) gives the same Result."""
    import numpy as np  # here: a CLI that imports the package for its configs stays light

    from diloco.simulate import decoupled, dp, sync_diloco

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    simpy = need_simpy()
    ctx = context(cfg)
    env = simpy.Environment()
    books = Books(allocated=cfg.chips * cfg.horizon_s)
    # One generator per run, seeded by the config alone: every mode sees the same failures.
    rng = np.random.default_rng(cfg.seed)
    run = {
        "dp": lambda: dp.run(env, ctx, books, rng, elastic=False),
        "elastic-dp": lambda: dp.run(env, ctx, books, rng, elastic=True),
        "sync-diloco": lambda: sync_diloco.run(env, ctx, books, rng),
        "decoupled": lambda: decoupled.run(env, ctx, books, rng),
    }[mode]
    env.process(run())
    env.run(until=cfg.horizon_s + 1e-9)
    books.uptime.set(min(env.now, ctx.end_s), 0)
    diloco_mode = mode in ("sync-diloco", "decoupled")
    return Result(
        mode=mode,
        chips=cfg.chips,
        learners=cfg.m if diloco_mode else 1,
        hours=cfg.hours,
        goodput=_share(books.useful, books.allocated),
        uptime=_share(books.uptime.total, cfg.horizon_s),
        wasted=_share(books.wasted, books.allocated),
        failures=books.failures,
        merge_halted=_share(books.halted_s, cfg.horizon_s),
        effective_h=ctx.sync.effective_h if diloco_mode else 0.0,
        sync={k: round(v, 4) for k, v in asdict(ctx.sync).items()},
        decisions=dict(sorted(books.reasons.items())),
    )


def _share(part: float, whole: float) -> float:
    return max(0.0, min(1.0, part / whole)) if whole > 0 else 0.0
