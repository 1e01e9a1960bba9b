"""Data parallel, synchronous and elastic, as simpy processes.

Synchronous DP is one program over every chip: a failure anywhere stops all of them until the
job restarts on a spare slice (rules.job_failure). Elastic DP pauses to drop the failed slice and
goes on with fewer chips; the slice is back after repair_s and rejoins at the job's next
reconfiguration, so a return costs no pause of its own (rules.elastic_failure).
"""

from __future__ import annotations

import heapq
from collections.abc import Generator
from typing import Any

import numpy as np

from diloco.simulate import rules
from diloco.simulate.books import Books, Context
from diloco.simulate.costs import group_pace, slow_count
from diloco.simulate.failures import SparePool, chip_failures


def pace(ctx: Context) -> float:
    """Useful work per chip per second of stepping: the slowest slice sets every step's pace,
    and DP's exposed all-reduce adds to each step."""
    cfg = ctx.cfg
    slow = slow_count(cfg.slices, cfg.straggler) > 0
    compute = cfg.step_s / group_pace(cfg.slices, cfg.straggler, slow)
    return cfg.step_efficiency * cfg.step_s / (compute + cfg.dp_exposed_comm_s)


def run(env: Any, ctx: Context, books: Books, rng: np.random.Generator, *, elastic: bool) -> Generator:
    cfg, rec = ctx.cfg, ctx.cfg.recovery
    fails = chip_failures(
        cfg.failure, chips=cfg.chips, slices=cfg.slices, units=cfg.slices, horizon_s=cfg.horizon_s, rng=rng
    )
    rate = pace(ctx)
    spares = SparePool(rec.spares, rec.repair_s)
    restart = rec.restart_s + rec.startup_s
    # stepping since `since` (None while down, until `resume_at`); `chips` step in elastic DP.
    since: float | None = None
    resume_at = min(cfg.job_startup_s, ctx.end_s)
    chips = float(cfg.chips)
    out: list[float] = []  # elastic: return times of slices under repair

    def bank(now: float) -> None:
        """Credit the stepping since the last event at the current size."""
        nonlocal since
        if since is not None and now > since:
            books.useful += chips * rate * (now - since)
            since = now

    for t, _slice in zip(fails.times, fails.units, strict=True):
        if t >= ctx.end_s:
            break
        yield env.timeout(t - env.now)
        if since is None and resume_at <= t:  # the restart or pause ended before this failure
            since = resume_at
            books.uptime.set(resume_at, 1)
        books.failures += 1
        stepping = since
        if elastic:
            decision = rules.elastic_failure(
                t,
                stepping_since=stepping,
                paused_until=resume_at,
                reconfigure_s=rec.reconfigure_s,
                kept=ctx.kept,
            )
        else:
            decision = rules.job_failure(
                t, stepping_since=stepping, down_until=resume_at, restart_s=restart, kept=ctx.kept
            )
        books.count(decision.action)
        bank(t)
        books.useful -= chips * rate * decision.lost_s
        books.wasted += chips * rate * decision.lost_s
        if since is not None:
            books.uptime.set(t, 0)
        since, resume_at = None, decision.resume_at
        if elastic:
            # The failed slice leaves; those back from repair rejoin in this same reconfiguration.
            while out and out[0] <= t:
                heapq.heappop(out)
            heapq.heappush(out, t + rec.repair_s)
            chips = max(0.0, cfg.chips - cfg.chips / cfg.slices * len(out))
        else:
            ready = spares.take(t)
            if ready > t:  # no spare: the restart begins when a repaired slice comes back
                resume_at = max(resume_at, ready + restart)
        resume_at = min(resume_at, ctx.end_s)
    # The end: credit the last stretch of stepping (its work is in the final checkpoint).
    yield env.timeout(max(0.0, ctx.end_s - env.now))
    if since is None and resume_at < ctx.end_s:
        since = resume_at
        books.uptime.set(resume_at, 1)
    bank(ctx.end_s)
    if since is not None:
        books.uptime.set(ctx.end_s, 0)
