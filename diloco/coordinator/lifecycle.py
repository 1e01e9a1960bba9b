"""The run's life, as pure functions of (state, now's facts, config): running → finishing → finished.

A run is `running` until its token budget of merged tokens is reached, its training data is
exhausted (every train chunk made into shards or quarantined, every train shard's rows merged: no
learner can be given anything more), or someone asks it to finish (`diloco finish`); `finishing`
tells every learner to hand in its work and leave; it is `finished` once no learner is left and
nothing merged waits to be published. Nothing goes back: a finished run stays finished (a
restarted coordinator reads the state from the ledger).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RUNNING, FINISHING, FINISHED = "running", "finishing", "finished"


@dataclass(frozen=True)
class RunStateChange:
    state: str | None  # the state to enter; None: stay
    reason: str


# Why a run finished on its own when its data ran out: recorded with the state, for the summary.
DATA_EXHAUSTED_REASON = "the training data is exhausted: every shard's rows are merged"


def may_enter(current: str, new: str) -> bool:
    """A state is entered once, and nothing leaves `finished`."""
    return new != current and current != FINISHED


def next_run_state(
    current: str,
    *,
    tokens_merged: int,
    budget: int,
    live_learners: int,
    work_unpublished: bool,
    data_exhausted: bool = False,
) -> RunStateChange:
    """What the ticker does with the run state now.

    The budget counts tokens merged into the model (the ledger's exact, durable count): work a kill
    or a restart throws away is not training, and a heartbeat counter restarts with its process.
    `data_exhausted`: no train chunk is pending or leased and every train shard is consumed (each
    of its rows merged), the ledger's own condition for telling a learner "no more data" (its
    LeaseShard done): a run started role by role then finishes on its own, as `diloco run`'s
    supervisor finishes it when its learners have left. A run with no budget otherwise stays
    `running` forever, its learners gone, its status never finished. (Default False: a caller
    that does not know the fact keeps the run going.)
    """
    if current == RUNNING:
        if budget and tokens_merged >= budget:
            return RunStateChange(FINISHING, f"token budget of {budget} reached")
        if data_exhausted:
            return RunStateChange(FINISHING, DATA_EXHAUSTED_REASON)
        return RunStateChange(None, f"{tokens_merged}/{budget or '∞'} tokens merged")
    if current == FINISHING:
        if live_learners:
            return RunStateChange(None, f"waiting for {live_learners} learner(s) to leave")
        if work_unpublished:
            return RunStateChange(None, "merges still being published")
        return RunStateChange(FINISHED, "every learner has left")
    return RunStateChange(None, f"run {current}")


@dataclass(frozen=True)
class Claim:
    """What a live learner holds of the token budget, as it reported at its last heartbeat: tokens
    it trained that no merge it took counts yet, the allowance it was given then (it may be
    training into it), how fast it trains (tokens per busy second; 0: not known yet), how long
    ago that was, and how many of its tokens the coordinator merged since."""

    unmerged: int
    allowed: int
    rate: float = 0.0
    age_s: float = 0.0
    merged_since: int = 0

    def _trained_since(self) -> int:
        """Of its allowance, what it has trained since it reported (estimated from its speed)."""
        return min(self.allowed, math.floor(self.rate * max(0.0, self.age_s)))

    @property
    def pending(self) -> int:
        """Trained and not merged yet, now. (A report a few seconds old undercounts it by what the
        learner trained since, and overcounts it by what merged since: at the end game, where
        a heartbeat's interval is a large part of what is left, that skewed the split.)"""
        return max(0, self.unmerged + self._trained_since() - self.merged_since)

    def untrained(self, horizon_s: float) -> int:
        """What is left of its allowance, counted for what it can train before it reports again
        (all of it while its speed is not known). Pending + untrained is never less than what it
        reported plus its allowance less what merged since, whatever the speed estimate says."""
        left = self.allowed - self._trained_since()
        if self.rate <= 0 or left <= self.rate * horizon_s:  # (an infinite horizon: all)
            return left
        return math.ceil(self.rate * horizon_s)


def training_allowance(
    *,
    budget: int,
    tokens_merged: int,
    mine: int,
    others: list[Claim],
    my_rate: float = 0.0,
    horizon_s: float = math.inf,
) -> int:
    """Tokens a learner may train past what it just reported, so that a Decoupled run merges its
    token budget and not a round more.

    The budget counts merged tokens, and a row's tokens merge only once every fragment was pushed
    after it: when the merged count reaches the budget, each learner still holds about H steps,
    and handing them in overshoots by M·H batches (+17% at M = 2, H = 100 on a 1.2 M-token run).
    So each learner claims what it holds unmerged plus what it may train of its allowance before
    it reports again (`horizon_s`: a few heartbeats), both as of now: a claim reported a heartbeat
    ago is aged by what its learner trained and what of its work merged since (Claim.pending;
    unaged, the end game's split leaned to whichever learner asked last, and the other waited
    out the difference: measured, 2 s of a 28 s run). What is left to train once every learner's
    unmerged work is counted is split by the learners' speeds (evenly while a speed is not known),
    and this one gets its share of it, less only what the others' allowances already hold of it:
    the learners run out together, and a fast learner is not left waiting on a slow one's half.
    (Its share of what the others left unclaimed was a share of a share: a 2-rank learner beside
    a 3x slower one got a quarter less than its speed's due at every ask, ran out mid-run again
    and again, and waited for the slow one's next heartbeat.) Far from the end the allowances are
    large, so a learner cut off from the coordinator for a while trains on. The budget holds to a
    batch per learner when every learner reports within the horizon; a claim counted twice (a
    merge the learner has not taken yet) only makes the allowance smaller for a moment; a learner
    that dies stops claiming once it is found dead.
    """
    to_train = budget - tokens_merged - mine - sum(c.pending for c in others)
    free = max(0, to_train - sum(c.untrained(horizon_s) for c in others))
    known = [r for r in (my_rate, *(c.rate for c in others)) if r > 0]
    typical = sum(known) / len(known) if known else 1.0

    def speed(r: float) -> float:
        return r if r > 0 else typical

    share = speed(my_rate) / (speed(my_rate) + sum(speed(c.rate) for c in others))
    return int(min(max(0, to_train) * share, free)) or free  # the last few tokens go whole: one more step
