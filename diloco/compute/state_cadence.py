"""When a learner copies its state to local disk: a pure decision, `now` in, a verdict and a reason out.

A copy costs the training thread its copy of every tensor it holds (parameters, the inner
AdamW's two moments, each fragment's base) and the writer thread a save of all of it: for the
built-in GPT at 86 M parameters, ~1.7 GB a copy. Taken every `train.local_state_every_s`
whatever the cost, copies of such a model cut two learners' tokens/s to 0.594 ± 0.036 of the same
run without local state on the 2-core machine, 3 seeds (benchmarks/local_state_cost.py; 0.917 ±
0.008 within the budget). So a copy also waits until the last
one's cost is at most `train.local_state_max_share` of the time since it: a small model copies
every few seconds as before, a large one as often as its budget allows.

Pushes do not make a copy due: a state older than the learner's last push is resumed with the
pushes after it from the push journal (push_journal), so the copies follow the clock and the
budget alone (before the journal a copy followed every push, the only state a resume could use).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CopyVerdict:
    due: bool
    reason: str
    held_by_cost: bool = False  # not due only because of the budget: worth a line in the log


def copy_due(
    now: float,
    *,
    last_copy: float,
    last_cost_s: float,
    every_s: float,
    max_share: float,
) -> CopyVerdict:
    """Whether the training thread copies its state at `now`.

    last_copy: when the last copy was taken (-inf: never); last_cost_s: its cost, the training
    thread's copy and the writer's save together."""
    since = now - last_copy
    spacing = last_cost_s / max_share if max_share > 0 else 0.0
    if since < spacing:
        return CopyVerdict(
            False,
            f"the last copy cost {last_cost_s:.2f}s, at most {max_share:.0%} of the time: "
            f"the next in {spacing - since:.1f}s",
            held_by_cost=True,
        )
    if since < every_s:
        return CopyVerdict(False, f"copied {since:.1f}s ago, every {every_s:g}s")
    return CopyVerdict(True, f"{since:.1f}s since the last copy")
