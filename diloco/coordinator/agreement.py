"""Which way each learner's recent deltas point against the other learners' own: the learner that
goes against every other one while those go one way is the odd one, whoever took the outer
momentum where.

The pusher watch's cosine to the momentum (pusher_watch.py) cannot always tell: a learner whose
deltas are merged takes the momentum its way, and then the momentum is partly its own. Measured: a
learner climbing the loss while it reports a low one (benchmarks/hostile_learner.py --arms liar)
was named by that cosine in two seeds of three; in the third, 24 of its pushes merged and the
held-out loss ended at 19.8. Here each learner's direction is its own: a running mean of its
deltas' sketches (delta_sample.Sketcher, fixed secret positions) per fragment, and a learner is
judged by its median cosine to the other learners' directions beside their median cosine to one
another (the pairs it is not in). An honest learner agrees with the others about as much as they
agree among themselves; one pushing up the loss points against all of them.

Kept in memory only: after a restart each learner's direction is built again from its next pushes
(the learners it named stay named: pusher_watch.restored).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

# A learner's direction is a running mean of its sketches: each push's weighs (1 - KEEP), so that
# the pushes of the last few rounds make it (a learner named and then pushing like the others
# comes back within a few pushes).
KEEP = 0.5
MIN_PUSHES = 2  # a learner's pushes of a fragment before its direction counts
MIN_LEARNERS = 3  # with two, nothing says which one is odd
MAX_LEARNERS = 512  # directions kept per fragment: the least recently pushed are let go
# Where the other learners' directions agree less than this (their median cosine to one another),
# no learner's can be told apart: honest deltas late in a run are mostly their batches' noise
# (measured: GPT learners' pairwise cosines fall from +0.9 at the start to +0.0-0.2), and a learner
# climbing the loss then stands near 0 to them as they do to one another. There a learner is
# neither named nor let go by its direction: its fragment's last verdict stands.
MIN_REFERENCE = 0.3
# ... and its median cosine to them must be below this: it points against them. Honest learners'
# cosines to the others stood at -0.03 at the lowest where their agreement could be told (a learner
# killed and resumed under chaos), a learner climbing the loss at -0.30 to -0.57 when it was named
# (twelve runs):
# a second guard, so that an honest learner must stand in both tails to be named.
AGAINST_BELOW = -0.15
# A learner named by its direction is let go where its median cosine to the other learners comes to
# this share of theirs to one another (where that can be told). Not a share of the bar: a learner
# climbing the loss and refused stands near 0 to the others as their own agreement falls through
# the run, its gap shrinking with theirs (measured in six runs: in the fragment that named it, at
# most +0.02 of theirs; in one run its other fragment named it too and came back to +0.93 there,
# let go in that one only; honest learners 0.51 at least, a 3x slower one 0.09 to 1.0).
LET_GO = 0.5
# The verdict of a learner named for its direction before the coordinator restarted (directions
# live in memory only): it stands until one of its fragments' can be told again, and is judged there
# as a named learner's (let go at LET_GO).
RESTORED = -1
AGAINST = "go against the other learners'"  # in every verdict's reason


@dataclass
class Direction:
    way: np.ndarray  # the running mean of its unit-length sketches
    pushes: int = 1


@dataclass(frozen=True)
class AgreementGap:
    gap: float  # its median cosine to the others less theirs to one another (negative: against them)
    cosine: float  # its median cosine to the other learners' directions
    reference: float  # theirs to one another
    learners: int  # how many live learners' directions were compared


class Agreement:
    """Each learner's direction of each fragment, and the cosine of every pair of them (kept as
    pushes come: one row per push)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # pushes come on many handler threads
        self.ways: dict[int, collections.OrderedDict[str, Direction]] = {}
        self.cosines: dict[int, dict[tuple[str, str], float]] = {}

    def add(self, worker: str, fragment: int, sketch: np.ndarray | None) -> None:
        """One more push's sketch (unit length; None: nothing to add) in its learner's direction,
        and that direction's cosine to every other learner's of the fragment."""
        if sketch is None:
            return
        with self._lock:
            ways = self.ways.setdefault(fragment, collections.OrderedDict())
            cosines = self.cosines.setdefault(fragment, {})
            mine = ways.pop(worker, None)
            if mine is None:
                mine = Direction(sketch.astype(np.float32, copy=True))
            else:
                mine.way = KEEP * mine.way + (1.0 - KEEP) * sketch
                mine.pushes += 1
            ways[worker] = mine  # the most recent last
            while len(ways) > MAX_LEARNERS:
                gone, _ = ways.popitem(last=False)
                for pair in [p for p in cosines if gone in p]:
                    del cosines[pair]
            norm = float(np.linalg.norm(mine.way))
            for other, theirs in ways.items():
                if other == worker:
                    continue
                denominator = norm * float(np.linalg.norm(theirs.way))
                cosine = float(np.dot(mine.way, theirs.way)) / denominator if denominator > 0 else 0.0
                cosines[_pair(worker, other)] = cosine

    def gaps(self, live: Collection[str]) -> dict[str, dict[int, AgreementGap]]:
        """Each live learner's gap against the others, fragment by fragment, where MIN_LEARNERS
        or more live learners have a direction of the fragment."""
        with self._lock:
            found: dict[str, dict[int, AgreementGap]] = {}
            for fragment, ways in self.ways.items():
                judged = sorted(w for w, d in ways.items() if w in live and d.pushes >= MIN_PUSHES)
                if len(judged) < MIN_LEARNERS:
                    continue
                for worker, gap in _fragment_gaps(judged, self.cosines[fragment]).items():
                    found.setdefault(worker, {})[fragment] = gap
            return found


def verdicts(gaps: Mapping[int, AgreementGap], carried: Mapping[int, str], bar: float) -> dict[int, str]:
    """A learner's verdict per fragment: why it goes against the other learners ("": it does not).
    Where the others agree enough to tell (MIN_REFERENCE): named where its gap stands more than
    `bar` below theirs and its cosine below AGAINST_BELOW, and, named (`carried`), until its
    cosine comes to LET_GO × theirs;
    elsewhere as last judged. A bar of 0: no verdicts."""
    if bar <= 0:
        return {}
    told_now = any(g.reference >= MIN_REFERENCE for g in gaps.values())
    out = {f: why for f, why in carried.items() if f not in gaps and not (f == RESTORED and told_now)}
    for fragment, g in gaps.items():
        named = carried.get(fragment, "") or carried.get(RESTORED, "")  # named before a restart: still
        if g.reference < MIN_REFERENCE:
            out[fragment] = named
        elif (named and g.cosine < LET_GO * g.reference) or (-g.gap > bar and g.cosine < AGAINST_BELOW):
            out[fragment] = (
                f"its recent deltas of fragment {fragment} {AGAINST}: median cosine {g.cosine:+.2f} "
                f"to theirs, theirs to one another {g.reference:+.2f} ({g.learners} live learners; "
                f"named more than {bar:g} apart, let go from {LET_GO:g}× theirs)"
            )
        else:
            out[fragment] = ""
    return out


def told(gaps: Mapping[int, AgreementGap]) -> AgreementGap | None:
    """A learner's gap furthest against the others, among fragments where it can be told."""
    return min((g for g in gaps.values() if g.reference >= MIN_REFERENCE), key=lambda g: g.gap, default=None)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _fragment_gaps(judged: list[str], cosines: dict[tuple[str, str], float]) -> dict[str, AgreementGap]:
    """For each learner: its median cosine to the others beside the median over the pairs it is
    not in."""
    n = len(judged)
    rows, cols = np.triu_indices(n, k=1)
    values = np.array(
        [cosines.get(_pair(judged[a], judged[b]), 0.0) for a, b in zip(rows, cols, strict=True)]
    )
    out = {}
    for i, worker in enumerate(judged):
        mine = (rows == i) | (cols == i)
        cosine, reference = float(np.median(values[mine])), float(np.median(values[~mine]))
        out[worker] = AgreementGap(cosine - reference, cosine, reference, n)
    return out
