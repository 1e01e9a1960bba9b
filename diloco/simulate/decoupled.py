"""Decoupled DiLoCo as simpy processes: M learners that never wait for each other.

A failure stops only the learner whose slice failed (rules.learner_failure): it loses its work
since its kept point, restarts, pulls the global model (rules.rejoin_at) and steps again; the
others go on. The syncer merges while the coordinator serves and at least K learners are alive
(rules.merging); while it cannot, learners keep stepping for halt_bound_s and then stop
(rules.may_step) until it can again. A coordinator failure is one such halt.

Each learner's work is kept as stepping seconds of its current life, banked when the life ends
(a failure, or the end of the run: the final flush pushes what is left).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from diloco.simulate import rules
from diloco.simulate.books import Books, Context
from diloco.simulate.costs import group_pace, slow_count
from diloco.simulate.failures import SparePool, chip_failures, coordinator_failures


@dataclass
class Learner:
    chips: float
    pace: float  # useful work per chip per second of stepping
    up: bool = False
    mark: float = 0.0  # stepping counted up to here
    stepped: float = 0.0  # stepping seconds of the current life
    restart_done: float = 0.0  # while down: when its restart ends (then it pulls)
    down_since: float | None = 0.0  # None while up
    gen: int = 0  # bumped by every failure: a superseded come-back process does nothing


class Decoupled:
    def __init__(self, env: Any, ctx: Context, books: Books, rng: np.random.Generator):
        self.env, self.ctx, self.books, self.rng = env, ctx, books, rng
        cfg = ctx.cfg
        m = cfg.m
        slow = slow_count(m, cfg.straggler)
        per = max(1, cfg.slices // m)
        self.learners = [
            Learner(chips=cfg.chips / m, pace=cfg.step_efficiency * group_pace(per, cfg.straggler, i < slow))
            for i in range(m)
        ]
        rec = cfg.recovery
        self.restart_s = rec.restart_s + rec.startup_s
        self.pull_s = rec.rejoin_pull_s if rec.rejoin_pull_s is not None else ctx.sync.full_pull_s
        self.spares = SparePool(rec.spares, rec.repair_s)
        self.alive = 0
        self.coordinator_up_at = 0.0
        self.halted_since: float | None = None
        self.frozen = False  # halted for longer than the bound: nobody steps
        self.halt_gen = 0
        self.started = False
        # A round needs one push of its fragment from each of K learners: every H steps.
        self.window_s = ctx.sync.effective_h * cfg.step_s / cfg.step_efficiency

    # The books --------------------------------------------------------------------------------

    def accrue(self, learner: Learner, now: float) -> None:
        if learner.up and not self.frozen:
            learner.stepped += now - learner.mark
        learner.mark = now

    def accrue_all(self, now: float) -> None:
        for learner in self.learners:
            self.accrue(learner, now)

    def bank(self, learner: Learner, lost_s: float) -> None:
        """A life ends: its stepping counts, less what was lost."""
        rate = learner.chips * learner.pace
        self.books.useful += (learner.stepped - lost_s) * rate
        self.books.wasted += lost_s * rate
        learner.stepped = 0.0

    def stepping_changed(self, now: float) -> None:
        self.books.uptime.set(now, 0 if self.frozen else self.alive)

    # Merging ------------------------------------------------------------------------------------

    def merging_changed(self, now: float) -> None:
        if not self.started:
            return
        members = rules.quorum_members(
            now, down_since=[learner.down_since for learner in self.learners], window_s=self.window_s
        )
        ok, _why = rules.merging(
            now, coordinator_up_at=self.coordinator_up_at, alive=members, quorum=self.ctx.cfg.outer.quorum
        )
        if not ok and self.halted_since is None:
            self.halted_since = now
            self.halt_gen += 1
            self.env.process(self.freeze(self.halt_gen, now))
        elif ok and self.halted_since is not None:
            self.books.halted_s += now - self.halted_since
            self.accrue_all(now)
            self.halted_since, self.frozen = None, False
            self.halt_gen += 1
            self.stepping_changed(now)

    def freeze(self, gen: int, since: float) -> Generator:
        bound = self.ctx.cfg.outer.halt_bound_s
        yield self.env.timeout(bound)
        now = self.env.now
        if gen == self.halt_gen and not rules.may_step(now, halted_since=since, halt_bound_s=bound):
            self.accrue_all(now)
            self.frozen = True
            self.books.count("stop-at-halt-bound")
            self.stepping_changed(now)

    # Learners and the coordinator ---------------------------------------------------------------

    def come_back(self, i: int, gen: int, pull_s: float, *, first: bool = False) -> Generator:
        """A learner steps again once restarted and pulled; its first start (job_startup_s, a
        measured time to the first step) already holds whatever it waited for."""
        learner = self.learners[i]
        yield self.env.timeout(max(0.0, learner.restart_done - self.env.now))
        if gen != learner.gen:
            return
        if not first:
            rejoin = rules.rejoin_at(self.env.now, coordinator_up_at=self.coordinator_up_at, pull_s=pull_s)
            yield self.env.timeout(max(0.0, rejoin.resume_at - self.env.now))
        if gen != learner.gen or self.env.now >= self.ctx.end_s:
            return
        now = self.env.now
        learner.up, learner.mark, learner.stepped, learner.down_since = True, now, 0.0, None
        self.alive += 1
        self.started = True
        self.stepping_changed(now)
        self.merging_changed(now)

    def learner_failed(self, i: int, now: float) -> None:
        learner = self.learners[i]
        self.accrue(learner, now)
        since = now - learner.stepped if learner.up else None
        decision = rules.learner_failure(
            now,
            stepping_since=since,
            back_at=learner.restart_done,
            restart_s=self.restart_s,
            kept=self.ctx.kept,
        )
        self.books.count(decision.action)
        if learner.up:
            self.bank(learner, decision.lost_s)
            learner.up, learner.down_since = False, now
            self.alive -= 1
            self.stepping_changed(now)
            self.env.process(self.window_over(now + self.window_s))
        done = decision.resume_at
        ready = self.spares.take(now)
        if ready > now:
            done = max(done, ready + self.restart_s)
        learner.restart_done = done
        learner.gen += 1
        self.env.process(self.come_back(i, learner.gen, self.pull_s))

    def window_over(self, at: float) -> Generator:
        """A learner down for a whole round's window no longer counts toward the quorum."""
        yield self.env.timeout(max(0.0, at - self.env.now))
        self.merging_changed(self.env.now)

    def coordinator_failed(self, now: float) -> Generator:
        rec = self.ctx.cfg.recovery
        decision = rules.coordinator_failure(
            now, up_at=self.coordinator_up_at, restart_s=rec.coordinator_restart_s
        )
        self.books.count(f"coordinator-{decision.action}")
        self.coordinator_up_at = decision.resume_at
        self.merging_changed(now)
        yield self.env.timeout(decision.resume_at - now)
        if self.env.now >= self.coordinator_up_at:
            self.merging_changed(self.env.now)

    def run(self) -> Generator:
        cfg, ctx = self.ctx.cfg, self.ctx
        for i, learner in enumerate(self.learners):
            learner.restart_done = min(cfg.job_startup_s, ctx.end_s)
            self.env.process(self.come_back(i, learner.gen, 0.0, first=True))
        fails = chip_failures(
            cfg.failure,
            chips=cfg.chips,
            slices=cfg.slices,
            units=cfg.m,
            horizon_s=cfg.horizon_s,
            rng=self.rng,
        )
        coord = coordinator_failures(cfg.failure, horizon_s=cfg.horizon_s, rng=self.rng)
        events = sorted([(float(t), 0, int(u)) for t, u in zip(fails.times, fails.units, strict=True)]
                        + [(float(t), 1, -1) for t in coord])  # fmt: skip
        for t, kind, unit in events:
            if t >= ctx.end_s:
                break
            yield self.env.timeout(t - self.env.now)
            if kind == 0:
                self.books.failures += 1
                self.learner_failed(unit, t)
            else:
                self.env.process(self.coordinator_failed(t))
        yield self.env.timeout(max(0.0, ctx.end_s - self.env.now))
        now = ctx.end_s
        self.accrue_all(now)
        for learner in self.learners:
            if learner.up:
                self.bank(learner, 0.0)  # the final flush pushes what is left
        if self.halted_since is not None:
            self.books.halted_s += now - self.halted_since
        self.frozen, self.alive = True, 0
        self.stepping_changed(now)


def run(env: Any, ctx: Context, books: Books, rng: np.random.Generator) -> Generator:
    return Decoupled(env, ctx, books, rng).run()
