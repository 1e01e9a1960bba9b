"""The run's life, as pure functions of (state, now's facts, config): running → finishing → finished.

A run is `running` until its token budget of merged tokens is reached (or someone asks it to
finish); `finishing` tells every learner to hand in its work and leave; it is `finished` once no
learner is left and nothing merged waits to be published. Nothing goes back: a finished run stays
finished (a restarted coordinator reads the state from the ledger).
"""

from __future__ import annotations

from dataclasses import dataclass

RUNNING, FINISHING, FINISHED = "running", "finishing", "finished"


@dataclass(frozen=True)
class RunStateChange:
    state: str | None  # the state to enter; None: stay
    reason: str


def may_enter(current: str, new: str) -> bool:
    """A state is entered once, and nothing leaves `finished`."""
    return new != current and current != FINISHED


def next_run_state(
    current: str, *, tokens_merged: int, budget: int, live_learners: int, work_unpublished: bool
) -> RunStateChange:
    """What the ticker does with the run state now.

    The budget counts tokens merged into the model (the ledger's exact, durable count): work a kill
    or a restart throws away is not training, and a heartbeat counter restarts with its process.
    """
    if current == RUNNING:
        if budget and tokens_merged >= budget:
            return RunStateChange(FINISHING, f"token budget of {budget} reached")
        return RunStateChange(None, f"{tokens_merged}/{budget or '∞'} tokens merged")
    if current == FINISHING:
        if live_learners:
            return RunStateChange(None, f"waiting for {live_learners} learner(s) to leave")
        if work_unpublished:
            return RunStateChange(None, "merges still being published")
        return RunStateChange(FINISHED, "every learner has left")
    return RunStateChange(None, f"run {current}")
