"""The syncer's decisions, as pure functions of (state, now, config).

Nothing here touches a clock, a socket or a lock: the service passes `now` in, so every decision
(when a round may close, which pushes may join it; merging.py: how they merge) is tested with a fake clock.
Synchronous DiLoCo is the special case quorum = every live learner, one fragment.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from diloco.config import SyncConfig


@dataclass(frozen=True)
class Arrival:
    """One push waiting in an open round (its tensors are kept elsewhere)."""

    worker_id: str
    tokens: int
    steps: int
    arrived_at: float
    base_version: int
    step_time_s: float = 0.0  # the pushing learner's seconds per inner step


@dataclass
class RoundState:
    """The open round of one fragment: pushes against `version` that will produce version+1."""

    fragment: int
    version: int
    opened_at: float
    arrivals: list[Arrival] = field(default_factory=list)
    # The learners live when its first delta came: the ones whose share of the work the merge is.
    members: frozenset[str] = frozenset()

    def pushed_by(self) -> set[str]:
        return {a.worker_id for a in self.arrivals}


@dataclass(frozen=True)
class CloseDecision:
    close: bool
    reason: str
    # When nothing changes before then, ask again at this time (None: only on a new event).
    recheck_at: float | None = None


def quorum_needed(policy: SyncConfig, live_learners: int) -> int:
    """Pushes a round needs. K = 0 means all live learners; never more than are alive."""
    if policy.quorum <= 0:
        return max(1, live_learners)
    return max(1, min(policy.quorum, live_learners)) if live_learners else policy.quorum


def grace_window(
    policy: SyncConfig, step_time_s: float, time_to_quorum_s: float, sync_time_s: float
) -> float:
    """How long to wait past quorum for more pushes: γ·(G·step_time − time_to_quorum − sync_time).

    The first pusher can use the merge G inner steps after its push (policy.gather_steps: τ, or
    more, since a learner applies a later merge when it comes and keeps its steps since the push).
    Of that time, reaching quorum has used time_to_quorum (from the first push) and merging will
    use sync_time; the rest is slack the syncer may spend waiting for stragglers without anyone
    waiting for it. The window is that slack scaled by γ, never negative.
    """
    slack = policy.gather_steps * step_time_s - time_to_quorum_s - sync_time_s
    return max(0.0, policy.grace_factor * slack)


def decide_close(
    state: RoundState,
    now: float,
    policy: SyncConfig,
    live_learners: Collection[str],
    step_time_s: float = 0.0,
    sync_time_s: float = 0.0,
    awaited: Collection[str] = (),
    awaited_until: float = 0.0,
) -> CloseDecision:
    """Whether the open round should merge now.

    `awaited`: learners whose pushes a coordinator restart dropped, and who will send them again;
    until `awaited_until` a round that has its quorum still waits for the live ones among them.
    """
    if not state.arrivals:
        return CloseDecision(False, "no pushes")
    pushed = state.pushed_by()
    live = set(live_learners)
    if live and live <= pushed:
        return CloseDecision(True, "every live learner pushed")
    needed = quorum_needed(policy, len(live))
    if len(pushed) < needed:
        return CloseDecision(False, f"{len(pushed)}/{needed} pushes for quorum")
    resending = (set(awaited) & live) - pushed
    if resending and now < awaited_until:
        return CloseDecision(
            False, f"waiting for {len(resending)} push(es) the restart dropped", recheck_at=awaited_until
        )
    first_by_worker: dict[str, Arrival] = {}
    for a in sorted(state.arrivals, key=lambda a: a.arrived_at):
        first_by_worker.setdefault(a.worker_id, a)
    ordered = list(first_by_worker.values())
    first, quorum_at = ordered[0], ordered[needed - 1].arrived_at
    # The first pusher needs the merge τ of *its* steps after its push: that is the time to share.
    step_time = first.step_time_s or step_time_s
    window = grace_window(policy, step_time, quorum_at - first.arrived_at, sync_time_s)
    if now >= quorum_at + window:
        return CloseDecision(True, "quorum reached" + (" and grace window over" if window > 0 else ""))
    return CloseDecision(False, "in grace window", recheck_at=quorum_at + window)


def missed_round_by(
    now: float,
    previous_first_push_at: float | None,
    previous_pushers: Collection[str],
    worker_id: str,
    period_s: float,
) -> float:
    """How late a push that opens a new round came for the fragment's previous round, or 0.

    With quorum K < M, learners whose schedules drift apart by more than the grace window stop
    meeting in rounds: each push then merges alone, against a base that lacks the others' latest
    work, and the outer momentum compounds that staleness (measured: quorum-1 rounds with two
    learners half a period apart end 5–9% above synchronous DiLoCo at equal tokens, the same
    schedule with both in every round 1.6%). A learner told it missed the round by d seconds
    pushes d earlier from then on, so the schedules line up again without anyone waiting. Only
    a miss of under half a sync period counts: past that, the push is early for the next round,
    not late for the last, and the other learner is the one to move.
    """
    if previous_first_push_at is None or worker_id in previous_pushers or period_s <= 0:
        return 0.0
    late = now - previous_first_push_at
    return late if 0.0 < late < period_s / 2 else 0.0


def late_in_round_by(
    now: float, first: Arrival | None, step_time_s: float, gather_steps: int, same_pace: float = 0.25
) -> float:
    """How late a push came into a round another learner opened, when that is worth a move, or 0.

    Learners that still meet in every round can stay apart for good: after a restart the
    returning learner pushes seconds after the other, every round (measured in four chaos runs:
    1.6 to 3.7 s apart on average against 0.1 to 0.6 s in their fault-free twins, and the eval
    ratio followed the lag: -0.4% at 1.6 s, +3.1% at 3.7 s, with every round holding both). The
    first pusher's merge then comes later than the steps it has to spare, and it trains that much
    longer on an old base. The late one is told half its lag, and pushes that much earlier from
    then on (as for missed_round_by): told the whole lag, the two leapfrogged (measured: 10-12
    steps each way, turn by turn, 1.6 s apart on average with a single kill), since each
    fragment's round says so and either may be the late one next. Halving makes the gap shrink
    each time whoever moves. Jitter is not chased: only a lag of more than half the gathering
    slack (G · step time / 2, SyncConfig.gather_steps) counts, and nothing when there is no
    overlap (synchronous rounds line learners up by themselves). Learners of different speeds
    push at different periods and cannot be lined up: only step times within `same_pace` of the
    first pusher's count.
    """
    if first is None or gather_steps <= 0 or step_time_s <= 0 or first.step_time_s <= 0:
        return 0.0
    if abs(step_time_s - first.step_time_s) > same_pace * first.step_time_s:
        return 0.0
    late = now - first.arrived_at
    return late / 2 if late > gather_steps * step_time_s / 2 else 0.0


def staleness_refusal(max_staleness: int, base_version: int, current_version: int) -> str | None:
    """Why a push based on `base_version` cannot join the round at `current_version`, or None."""
    if base_version > current_version:
        return f"push is based on version {base_version}, newer than the syncer's {current_version}"
    lag = current_version - base_version
    if lag > max_staleness:
        return f"push is {lag} version(s) stale (based on {base_version}, now {current_version}; max staleness {max_staleness})"
    return None
