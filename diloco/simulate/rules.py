"""The model's rules: what a failure does in each mode, as pure functions of the state and `now`.

Each rule takes the state it needs (built by hand in the tests, with timestamps moved by hand)
and returns a Decision: when the affected part steps again, how much work it lost, and a reason
a person can read. The engine (diloco.simulate.engine) only keeps the clock and the books.

Work is counted in *stepping seconds*: the time a program spent stepping, from which useful
chip-time follows as chips x stepping seconds x pace (costs.group_pace).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class Decision:
    """What a failure does."""

    action: str  # restart | restart-again | reconfigure | reconfigure-again | rejoin | ignore
    resume_at: float  # when the affected program steps again (INF: not known yet)
    lost_s: float  # stepping seconds of work thrown away
    reason: str


@dataclass(frozen=True)
class KeptState:
    """How a program keeps its work safe (from RecoveryConfig and the outer loop)."""

    step_s: float  # its step time (one step in progress is lost when state is kept every step)
    state_every_s: float = 0.0  # 0: every step
    state_lag_s: float = 0.0
    state_survives: bool = True
    # DiLoCo only: pushes carry work too (0 fragments: not a DiLoCo learner)
    push_interval_s: float = 0.0  # H / P steps
    fragments: int = 0
    push_s: float = 0.0  # a push lands this long after it is sent


def state_kept_s(stepped_s: float, kept: KeptState) -> float:
    """Stepping seconds of this life that a failure now would not lose, by the saved state.

    Saved every state_every_s (0: at every step boundary) and safe state_lag_s after; the life's
    own start (a resumed or pulled state) is kept by definition.
    """
    if not kept.state_survives:
        return 0.0
    every = kept.state_every_s if kept.state_every_s > 0 else kept.step_s
    if stepped_s < kept.state_lag_s:
        return 0.0
    return min(stepped_s, every * math.floor((stepped_s - kept.state_lag_s) / every))


def push_kept_s(stepped_s: float, kept: KeptState) -> float:
    """Stepping seconds of this life carried by landed pushes: rows count once every fragment
    has a push that landed after them (the learner's rows.carry), so the kept point is the
    oldest of the last P landed pushes. A push still on the wire has not landed."""
    if kept.fragments <= 0 or kept.push_interval_s <= 0:
        return 0.0
    made = math.floor(stepped_s / kept.push_interval_s)
    landed = made if stepped_s - made * kept.push_interval_s >= kept.push_s else made - 1
    return max(0.0, (landed - kept.fragments + 1) * kept.push_interval_s)


def lost_work(stepped_s: float, kept: KeptState) -> float:
    """Stepping seconds a failure throws away, `stepped_s` into a life."""
    return max(0.0, stepped_s - max(state_kept_s(stepped_s, kept), push_kept_s(stepped_s, kept)))


def job_failure(
    now: float, *, stepping_since: float | None, down_until: float, restart_s: float, kept: KeptState
) -> Decision:
    """Synchronous data parallel: any failure stops every chip until the job restarts.

    stepping_since: when the job last started stepping (None: it is restarting until
    down_until). A failure during a restart starts the restart again: the new failed slice has to
    be replaced too, and the job forms its collectives once more.
    """
    if stepping_since is None or now < stepping_since:
        return Decision(
            "restart-again", max(down_until, now + restart_s), 0.0,
            f"a failure during the restart (due at {down_until:.0f}s): the restart begins again",
        )  # fmt: skip
    lost = lost_work(now - stepping_since, kept)
    return Decision(
        "restart", now + restart_s, lost,
        f"a failure stops all chips; {lost:.1f}s of stepping since the last kept state is lost",
    )  # fmt: skip


def elastic_failure(
    now: float, *, stepping_since: float | None, paused_until: float, reconfigure_s: float, kept: KeptState
) -> Decision:
    """Elastic data parallel: the job pauses to drop the failed slice, then goes on smaller.

    Its other chips keep their state; only the step in progress is lost. A failure during a pause
    lengthens it: the reconfiguration starts again with one slice fewer.
    """
    if stepping_since is None or now < stepping_since:
        return Decision(
            "reconfigure-again", max(paused_until, now + reconfigure_s), 0.0,
            "a failure during a reconfiguration: it begins again without that slice too",
        )  # fmt: skip
    lost = lost_work(now - stepping_since, KeptState(step_s=kept.step_s))
    return Decision(
        "reconfigure", now + reconfigure_s, lost,
        f"the job pauses {reconfigure_s:.0f}s to drop the slice and goes on smaller; the step in progress is lost",
    )  # fmt: skip


def learner_failure(
    now: float, *, stepping_since: float | None, back_at: float, restart_s: float, kept: KeptState
) -> Decision:
    """Decoupled (or synchronous) DiLoCo: a failure stops only its learner.

    It loses its stepping since its kept point (saved state, or its last complete set of landed
    pushes), restarts, and then pulls the global model (rejoin_at). The other learners go on. A
    failure while it restarts restarts it again.
    """
    if stepping_since is None or now < stepping_since:
        return Decision(
            "restart-again", max(back_at, now + restart_s), 0.0,
            "the learner failed again while restarting: its restart begins again",
        )  # fmt: skip
    lost = lost_work(now - stepping_since, kept)
    return Decision(
        "restart", now + restart_s, lost,
        f"only this learner stops; it loses {lost:.1f}s of stepping, the others never wait",
    )  # fmt: skip


def rejoin_at(restarted_at: float, *, coordinator_up_at: float, pull_s: float) -> Decision:
    """A restarted learner steps again once it has pulled every fragment from the coordinator:
    while the coordinator is down, the pull waits for it."""
    start = max(restarted_at, coordinator_up_at)
    why = "pulls the global model" if start == restarted_at else "waits for the coordinator, then pulls"
    return Decision("rejoin", start + pull_s, 0.0, f"restarted; {why} ({pull_s:.1f}s)")


def quorum_members(now: float, *, down_since: list[float | None], window_s: float) -> int:
    """Learners that can be in the current round: those up, and those down for less than one
    round's window (H steps: a round needs one push of the fragment from each, and one that is
    back within the window still makes it)."""
    return sum(1 for since in down_since if since is None or now - since < window_s)


def merging(now: float, *, coordinator_up_at: float, alive: int, quorum: int) -> tuple[bool, str]:
    """Whether the syncer can merge now: the coordinator serves and at least K learners can push
    into the round (alive: quorum_members)."""
    if now < coordinator_up_at:
        return False, f"coordinator down until {coordinator_up_at:.0f}s"
    if alive < quorum:
        return False, f"{alive} learner(s) can push, quorum {quorum}"
    return True, "merging"


def coordinator_failure(now: float, *, up_at: float, restart_s: float) -> Decision:
    """The coordinator fails: merging stops until it restarts from its ledger; learners keep
    stepping (up to halt_bound_s, see may_step). A failure during its restart restarts it."""
    if now < up_at:
        return Decision(
            "restart-again", max(up_at, now + restart_s), 0.0, "coordinator failed while restarting"
        )
    return Decision(
        "restart", now + restart_s, 0.0,
        "the coordinator restarts from its durable ledger; learners keep training, merges wait",
    )  # fmt: skip


def may_step(now: float, *, halted_since: float | None, halt_bound_s: float) -> bool:
    """Learners keep stepping while merging is halted, for at most halt_bound_s
    (sync.max_unreachable_s): beyond it their work could not be merged soon enough to count."""
    return halted_since is None or now - halted_since < halt_bound_s


def sync_round_failure(
    now: float,
    *,
    round_started: float,
    stepping_since: float | None,
    back_at: float,
    done_at: float | None,
    sync_started: float | None,
    restart_s: float,
    kept: KeptState,
) -> Decision:
    """Synchronous DiLoCo: a learner fails during a round; everyone waits at the outer step.

    Its work since the round began (or since its saved state) is lost, unless its delta had
    already landed during the outer step (sync_started + push_s); it restarts, pulls the global
    model and redoes the rest of its H steps while the others wait.
    done_at: when it finished its H steps (None: still stepping); sync_started: when the outer
    step began (None: not yet).
    """
    if stepping_since is None or now < stepping_since:
        return Decision("restart-again", max(back_at, now + restart_s), 0.0, "failed again while restarting")
    if sync_started is not None and now >= sync_started + kept.push_s:
        return Decision("ignore", now, 0.0, "its delta had landed: the round closes without it waiting")
    # The round's start is a kept point (the global model every learner pulled).
    end = done_at if done_at is not None and done_at <= now else now
    stepped = max(0.0, end - max(stepping_since, round_started))
    lost = lost_work(stepped, KeptState(step_s=kept.step_s, state_every_s=kept.state_every_s,
                                        state_lag_s=kept.state_lag_s, state_survives=kept.state_survives))  # fmt: skip
    where = "during the outer step, before its delta landed" if sync_started is not None else "mid-round"
    return Decision(
        "restart", now + restart_s, lost,
        f"failed {where}: {lost:.1f}s of its round lost; every learner waits for it",
    )  # fmt: skip
