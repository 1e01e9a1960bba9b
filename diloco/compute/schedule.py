"""When a learner pushes which fragment, and when a merged fragment is applied: pure functions.

Streaming DiLoCo: with P fragments and H inner steps, a learner pushes one fragment every H/P
steps, round-robin, so each fragment is pushed every H steps. The merged result is applied τ
(overlap) steps after its push; τ = 0 means the learner waits for it (synchronous DiLoCo).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from diloco.compute.held import HeldFragment
from diloco.config import RunConfig

T = TypeVar("T")


def push_interval(inner_steps: int, fragments: int) -> int:
    """Inner steps between two pushes (of different fragments)."""
    return max(1, inner_steps // max(1, fragments))


def fragment_due(step: int, inner_steps: int, fragments: int) -> int | None:
    """The fragment to push after completing inner step `step` (1-based), or None.

    Pushes happen at steps interval, 2·interval, ...; the k-th push is of fragment (k−1) mod P.
    """
    interval = push_interval(inner_steps, fragments)
    if step <= 0 or step % interval:
        return None
    return (step // interval - 1) % fragments


def catch_up_steps(missed_by_s: float, step_time_s: float, interval: int) -> int:
    """Steps to bring the push schedule forward after missing a round by `missed_by_s`: at most
    half an interval at once (pushes keep at least half their steps; a larger gap closes over
    the next few pushes)."""
    if missed_by_s <= 0 or step_time_s <= 0:
        return 0
    return min(interval // 2, round(missed_by_s / step_time_s))


def resume_lag_steps(since_copy_s: float, steps_made: int, step_time_s: float, interval: int) -> int:
    """Steps a resumed learner's push schedule runs behind the others': what they stepped since
    its local state was copied, less what it made up since (its steps since resuming, and the
    schedule moved past the pushes its journal replayed); at most half an interval (its pushes
    keep at least half their steps; the coordinator's late reports do the rest).

    Its last life was in step with them at the copy; the steps after the copy died with it, and
    so did the restart's seconds. Left as it is, every round it pushes to waits seconds for it
    while the other learners train on an old base (syncer.late_in_round_by), for the rounds the
    halving catch-up takes to close the gap, and a kill every few seconds never lets it close."""
    if since_copy_s <= 0 or step_time_s <= 0 or interval <= 1:
        return 0
    return max(0, min(interval // 2, round(since_copy_s / step_time_s) - steps_made))


def past_replayed_pushes(
    position: int, fragments_pushed: Sequence[int], inner_steps: int, fragments: int
) -> int:
    """Steps to move a push schedule at `position` (steps + shift, a local state's) past the
    pushes its dead life made after the copy, in order: each at the first push point of its
    fragment from the last one on (the first may be at `position` itself: a copy and a push at
    the same step come in either order). Without it the resumed life pushes those fragments again
    at the same points, with only the steps since it resumed, early for the others' next round."""
    interval = push_interval(inner_steps, fragments)
    at, first = position, True
    for p in fragments_pushed:
        k = max(1, -(-at // interval) if first else at // interval + 1)  # the first point at / after `at`
        k += (p - (k - 1)) % fragments  # point k is fragment (k - 1) mod P's (fragment_due)
        at, first = k * interval, False
    return at - position


def advance_now(behind: int, position: int, interval: int) -> int:
    """How many of `behind` steps the push schedule (at `position` = steps + shift) moves forward
    now: never past the next push due, so that none is skipped (a push due at this very step
    comes first, and the move waits for the next call)."""
    return max(0, min(behind, (-position) % interval))


def apply_due(step: int, apply_at: int) -> bool:
    """A merged fragment that has arrived is applied once the learner reached step `apply_at`."""
    return step >= apply_at


def mix(local: T, merged: T, alpha: float) -> T:
    """θ ← α·θ_local + (1−α)·Θ_merged (α = 0: overwrite); numbers or tensors alike."""
    return alpha * local + (1.0 - alpha) * merged


def must_block(unreachable_for_s: float, bound_s: float) -> bool:
    """A learner stops stepping only when the syncer has been unreachable for longer than bound_s."""
    return bound_s > 0 and unreachable_for_s > bound_s


def token_share(cfg: RunConfig) -> int:
    """The tokens one learner trains in a synchronous run with a budget dealt over data.deal
    learners (0: no share, the coordinator's budget alone ends the run).

    Synchronous learners step in lockstep, so each stopping at its share of the budget ends the run
    on the same step every time; the coordinator's budget counts merged tokens and is seen by
    learners only at their next heartbeat, a timing-dependent number of steps later. Decoupled
    learners keep the coordinator's budget: a faster one trains more, as it should.
    """
    if not (cfg.sync.synchronous and cfg.data.deal and cfg.train.max_tokens):
        return 0
    return -(-cfg.train.max_tokens // cfg.data.deal)


def share_done(tokens_trained: int, cfg: RunConfig) -> bool:
    share = token_share(cfg)
    return share > 0 and tokens_trained >= share


def budget_spent(tokens_trained: int, allowance: tuple[int, int] | None) -> bool:
    """A Decoupled learner has trained what the coordinator allowed it of the token budget since
    its last heartbeat: (tokens_trained as reported, tokens allowed past it); None: no limit. It
    may step while any of the allowance is left, so it overshoots by less than one batch."""
    return allowance is not None and tokens_trained - allowance[0] >= allowance[1]


# -- the end game ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HandIn:
    """What a learner does with its work when it stops training or runs out of data."""

    push: list[int]  # fragments to push now: they hold steps, and no push of theirs is in flight
    give_back: bool  # nothing left to push or wait for: rows no push carries go back to the pool
    reason: str


def hand_in(frags: Sequence[HeldFragment]) -> HandIn:
    """What a learner hands in when it stops training: the fragments to push, else whether to give back.

    The fragment pushed longest ago (most steps since) goes first, as the schedule would have it,
    and every row rides on its push (rows.RowBook.hand_in): the coordinator credits each push
    ahead of its rows by the schedule, so that fragment is the one with credit left for them.
    The others follow with none of their own (at most P − 1 such pushes follow a push with rows).
    Before, fragment order with rows waiting for their cover: a learner that pushed fragment 0
    once and handed in at once pushed fragment 0 again with no rows, and the coordinator refused
    that second rowless push in a row (seen in a quorum-2 run, whose last round then waited)."""
    pending = sorted(
        (p for p, f in enumerate(frags) if f.steps and not f.in_flight), key=lambda p: -frags[p].steps
    )
    if pending:
        return HandIn(pending, False, f"fragment(s) {pending} hold unpushed steps")
    if any(f.in_flight for f in frags):
        return HandIn([], False, "pushes in flight: their merges come first")
    return HandIn([], True, "every step is pushed and merged")


def empty_push_due(now: float, last_empty_push: float, period_s: float) -> bool:
    """A starved learner with nothing to push says so every period_s (an empty push): quorum rounds
    then go on without it instead of waiting for its grace window."""
    return now - last_empty_push >= period_s


def loop_end(*, stopped: bool, finishing: bool, no_more_data: bool, share_done: bool) -> str | None:
    """Why the training loop ends now, or None: it goes on."""
    if stopped:
        return "stopped"
    if finishing:
        return "run finishing"
    if no_more_data:
        return "no more data"
    if share_done:
        return "token share trained"
    return None
