"""Synchronous DiLoCo as a simpy process: M learners, one outer step every H steps, all waiting.

Round by round: every learner steps H inner steps, then the outer step moves the whole model
(one fragment, no overlap: push, merge, pull) while nobody steps. A learner that fails loses its
round's work since its kept state, restarts, pulls the round's global model and redoes what it
lost, and the round's outer step waits for it (rules.sync_round_failure); so does a slow learner.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import numpy as np

from diloco.simulate import rules
from diloco.simulate.books import Books, Context
from diloco.simulate.config import SimConfig
from diloco.simulate.costs import group_pace, slow_count, transfer_seconds
from diloco.simulate.failures import SparePool, chip_failures

# Rounds one run may walk (about 10 us each): unlike the other modes, synchronous DiLoCo has an
# event per outer step, so a long horizon over a short step (hours 1e9) ran for ever.
MAX_ROUNDS = 1_000_000


def check_rounds(cfg: SimConfig) -> None:
    """Refuse a run of more outer steps than MAX_ROUNDS (at most horizon / (H x step_s))."""
    rounds = cfg.horizon_s / (cfg.outer.inner_steps * cfg.step_s)
    if rounds > MAX_ROUNDS:
        raise ValueError(
            f"sync-diloco: hours / (inner_steps x step_s) gives up to {rounds:.3g} outer steps, over the "
            f"simulator's cap of {MAX_ROUNDS:,}: lower hours, or raise step_s or inner_steps"
        )


def union_length(segments: list[tuple[float, float]]) -> float:
    """Total length covered by the segments (time at least one learner stepped)."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(segments):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def run(env: Any, ctx: Context, books: Books, rng: np.random.Generator) -> Generator:
    cfg, rec = ctx.cfg, ctx.cfg.recovery
    check_rounds(cfg)
    m, h = cfg.m, cfg.outer.inner_steps
    slow = slow_count(m, cfg.straggler)
    per = max(1, cfg.slices // m)
    pace = [cfg.step_efficiency * group_pace(per, cfg.straggler, i < slow) for i in range(m)]
    need = [h * cfg.step_s / p for p in pace]  # stepping seconds of one round's H steps
    chips = cfg.chips / m
    restart = rec.restart_s + rec.startup_s
    pull = rec.rejoin_pull_s if rec.rejoin_pull_s is not None else ctx.sync.full_pull_s
    outer_s = 2 * transfer_seconds(cfg.link.params, cfg.link) + cfg.link.merge_s * cfg.outer.fragments
    kept = rules.KeptState(step_s=ctx.kept.step_s, state_every_s=rec.state_every_s, state_lag_s=rec.state_lag_s,
                           state_survives=rec.state_survives, push_s=transfer_seconds(cfg.link.params, cfg.link))  # fmt: skip
    spares = SparePool(rec.spares, rec.repair_s)
    fails = chip_failures(
        cfg.failure, chips=cfg.chips, slices=cfg.slices, units=m, horizon_s=cfg.horizon_s, rng=rng
    )
    times, units = fails.times, fails.units
    k = 0
    back = [cfg.job_startup_s] * m  # when each learner can step (later while it restarts)
    t0 = cfg.job_startup_s
    while t0 < ctx.end_s:
        since = [max(t0, b) for b in back]  # a restarting learner joins the round when back
        restart_done = [b - pull if b > t0 else t0 for b in back]
        done = [s + n for s, n in zip(since, need, strict=True)]
        banked = [0.0] * m  # stepping seconds of this round kept across a learner's failure
        segments: list[tuple[float, float]] = []
        late = list(back)  # when each learner is back for the next round
        while True:
            compute_end = max(done)
            round_end = compute_end + outer_s
            tf = float(times[k]) if k < len(times) else math.inf
            if tf >= min(round_end, ctx.end_s):
                break
            yield env.timeout(tf - env.now)
            i, k = int(units[k]), k + 1
            books.failures += 1
            stepping = since[i] if since[i] <= tf else None
            decision = rules.sync_round_failure(
                tf, round_started=t0, stepping_since=stepping, back_at=restart_done[i], done_at=done[i],
                sync_started=compute_end if tf >= compute_end else None, restart_s=restart, kept=kept,
            )  # fmt: skip
            books.count(decision.action)
            resume = decision.resume_at
            ready = spares.take(tf)
            if ready > tf:
                resume = max(resume, ready + restart)
            rejoined = rules.rejoin_at(resume, coordinator_up_at=0.0, pull_s=pull).resume_at
            if decision.action == "ignore":  # its delta landed: the round ends without it
                late[i] = rejoined
                continue
            if stepping is not None:
                stepped = min(tf, done[i]) - stepping
                segments.append((stepping, min(tf, done[i])))
                banked[i] += stepped - decision.lost_s
                books.wasted += decision.lost_s * chips * pace[i]
            restart_done[i], since[i] = resume, rejoined
            done[i] = rejoined + max(0.0, need[i] - banked[i])
        end = min(round_end, ctx.end_s)
        yield env.timeout(max(0.0, end - env.now))
        for i in range(m):
            if since[i] < end:
                stop = min(done[i], end)
                segments.append((since[i], stop))
                banked[i] += stop - since[i]
            books.useful += banked[i] * chips * pace[i]
        books.uptime.total += union_length([(a, min(b, end)) for a, b in segments if a < end])
        back = [max(lt, round_end) for lt in late]
        t0 = round_end
