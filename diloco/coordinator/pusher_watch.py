"""Each learner's recent deltas against the others': how large (over the outlier check's median of
the other workers' norms) and which way (cosine to the fragment's outer momentum, beside the other
learners' cosines), over all its pushes and fragment by fragment, and the pure decision that a
learner's pushes look hostile or broken, with its reason.

A norm bound limits how far one push moves the model, not where to: within it an authenticated
learner can wreck a run (README, "Who may talk to the coordinator"), and so can a broken one (a
faulty GPU, corrupt data) whose deltas are finite. One push says little (an honest delta can stand
at 4× the median); a learner's last pushes together tell it apart. The coordinator says so (status,
Prometheus, one log line when it changes) and, with `sync.refuse_suspects` (the default), refuses
its pushes while it is named; cutting it off for good is the operator's call (`diloco certs revoke`).

Direction is judged against the other learners, not against the momentum alone: a learner that
pushes more than the others takes the momentum with it, and then the honest learners' deltas are
the ones that point against it (measured: benchmarks/outer_sim.py --hostile). What stands out is
the learner whose cosine is not the others': far from the median of every live learner's (its own
included, so that with three learners one odd one cannot move it). With fewer than three nothing
says which is the odd one, and no direction is judged. Nor against the momentum only: each
learner's direction is also compared with the other learners' own (agreement.py), which a learner
that took the momentum its way cannot shape.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.coordinator.agreement import AGAINST, RESTORED, Agreement, told, verdicts

WATCH_PUSHES = 16  # a learner's last pushes the figures are over (of all fragments, and of each)
ALL = -1  # the figures over every fragment's pushes together
MIN_WATCHED = 6  # fewer say nothing yet
MIN_JUDGED = 3  # direction is judged among at least this many live learners' figures
# The bars (benchmarks/pusher_watch.py, results/pusher_watch.json): honest learners came to 1.35
# and 0.16 at most (GPT at H = 10 and 20, a 3× slower learner, int8, synchronous, kills under
# chaos, the digits CNN); one learner of three pushing its delta reversed at 1 to 9.9× the others'
# median stood 0.40 to 1.30 from the others' cosine (0.85 and more below 2×), and 1 to 9.9 in norm.
# Their defaults (config: sync.suspect_norm_ratio, sync.suspect_alignment_gap):
SUSPECT_RATIO = 2.0  # the median of a learner's last norm ratios above this
SUSPECT_GAP = 0.35  # its mean cosine to the momentum this far from the live learners' median
# The training loss its pushes report (a learner climbing the loss, a broken one, says so itself;
# a hostile one can lie, and is left to the rules above): the median of its last pushes' losses
# stands above the other learners' median by this share of the run's first round's loss (the
# scale a loss moves on: a ratio of two losses near 0, as a classifier's end, says nothing). An
# honest learner 3× slower than the others came to 0.37, the digits CNN to 0.47 (its loss falls
# from 2.3 to 0.1 within a few pushes), a learner climbing the loss to 0.80-0.91 at its third push,
# and more with every push it climbs (results/pusher_watch_release.json, hostile_learner*.json).
SUSPECT_LOSS = 0.75
MIN_LOSSES = 3  # a push's loss is a mean over its inner steps: a few tell a learner apart
# A learner's direction against the other learners' own (agreement.py): its median cosine to theirs
# this far below their median cosine to one another (and below agreement.AGAINST_BELOW itself).
# Honest learners came to 0.56 at most over 18 runs (the configurations above, two seeds each; the
# 3x slower learner and chaos two more); a learner climbing the loss and lying about it stood
# 0.98-1.11 apart at its 3rd push, in six runs of six (results/pusher_watch_agreement*.json,
# hostile_learner_agreement.json).
SUSPECT_DISAGREEMENT = 0.7
# A named learner is judged against this share of each bar until it no longer looks hostile or
# broken: a learner whose figure stands near a bar is not named and un-named push by push, its
# pushes merged between. Measured: a climber first named at a loss excess of 1.01-1.10 (the bar then
# 1.0) was un-named with 2-3 of its pushes merged after in two runs of four; in CI one such run
# ended at 3.03, near the unigram baseline. Honest learners' highest figures stand below 3/4 of
# every bar (above), so one named by mistake still comes back.
RELEASE = 0.75
# How a push is refused while its learner is named (sync.refuse_suspects), before the reason.
SUSPECT_REFUSAL = "its learner looks hostile or broken (sync.refuse_suspects)"
# A learner's figures in status (PusherWatch.figures) that a run's summary keeps.
WATCH_FIGURES = (
    "delta_norm_ratio",
    "delta_alignment",
    "delta_norm_ratio_highest",
    "delta_alignment_gap_largest",
    "delta_disagreement_largest",
    "loss_excess",
    "loss_excess_highest",
)


@dataclass
class FragmentFigures:
    """A learner's last pushes (of every fragment, or of one): each one's norm ratio (over every
    fragment only) and alignment, with the number of the learner's push it came with."""

    ratios: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=WATCH_PUSHES)
    )
    alignments: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=WATCH_PUSHES)
    )

    def add(self, push: int, ratio: float | None, alignment: float | None) -> None:
        if ratio is not None and math.isfinite(ratio):
            self.ratios.append((push, ratio))
        if alignment is not None and math.isfinite(alignment):
            self.alignments.append((push, alignment))

    def median(self, after: int = 0) -> tuple[float, int] | None:
        """The median norm ratio of its pushes numbered above `after` and how many (None: fewer
        than MIN_WATCHED)."""
        kept = [x for n, x in self.ratios if n > after]
        return (statistics.median(kept), len(kept)) if len(kept) >= MIN_WATCHED else None

    def mean(self, after: int = 0) -> float | None:
        kept = [x for n, x in self.alignments if n > after]
        return statistics.fmean(kept) if len(kept) >= MIN_WATCHED else None


@dataclass
class PusherWatch:
    """One learner's last pushes, over every fragment (ALL) and fragment by fragment. Directions
    are judged both ways: all together gather evidence fastest where a learner stands out in
    every fragment (a delta reversed whole: named after 8 pushes), each fragment on its own finds
    one that stands out in one fragment only (measured: a learner climbing the loss, one
    fragment's cosine +0.9 against the others' +0.4, the other like theirs, looked ordinary over
    both and was named after 18-19 pushes, or never; fragment by fragment after 12-21:
    results/hostile_learner_per_fragment.json)."""

    fragments: dict[int, FragmentFigures] = field(default_factory=dict)
    # The training loss each of its last pushes reported (finite ones), over every fragment: each
    # push reports the learner's mean loss over its inner steps.
    losses: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=WATCH_PUSHES)
    )
    last_at: float = 0.0  # when it last pushed (the service's clock)
    suspect: str = ""  # the reason last decided ("": none); the service logs when it comes and goes
    pushes: int = 0  # how many it made (numbering each push's figures)
    # Named, the number of its last push before: it is judged on its pushes after that one only
    # (judged_after), and stays named until MIN_WATCHED of them can judge it again.
    named_after: int | None = None
    # The nearest the learner came to each bar in this coordinator's life: how much room an
    # honest one leaves.
    highest_ratio: float | None = None
    largest_gap: float | None = None
    largest_disagreement: float | None = None  # the most it went against the others (agreement.py)
    against: Mapping[int, str] = field(default_factory=dict)  # its last verdicts there, by fragment
    loss_excess: float | None = None  # as last judged
    highest_loss_excess: float | None = None

    def add(
        self,
        now: float,
        ratio: float | None,
        alignment: float | None,
        fragment: int = 0,
        loss: float | None = None,
    ) -> None:
        self.last_at = now
        self.pushes += 1
        if loss is not None and math.isfinite(loss):
            self.losses.append((self.pushes, loss))
        # Norms are judged over all its pushes only (ratio_median): a fragment keeps directions.
        self.fragments.setdefault(ALL, FragmentFigures()).add(self.pushes, ratio, alignment)
        self.fragments.setdefault(fragment, FragmentFigures()).add(self.pushes, None, alignment)
        median = self.ratio_median()
        if median is not None and ratio is not None:
            self.highest_ratio = max(self.highest_ratio or 0.0, median[0])

    def take(self, judgement: Judgement) -> bool:
        """A judgement of this learner: its reason kept, its gap in the largest so far. True when
        it came to look hostile or broken, or no longer does (its figures move push by push)."""
        if judgement.gap is not None:
            self.largest_gap = max(self.largest_gap or 0.0, abs(judgement.gap))
        if judgement.agreement_gap is not None:
            self.largest_disagreement = max(self.largest_disagreement or 0.0, -judgement.agreement_gap)
        self.loss_excess = judgement.loss_excess
        self.against = judgement.against
        if judgement.loss_excess is not None:
            self.highest_loss_excess = max(self.highest_loss_excess or 0.0, judgement.loss_excess)
        changed = bool(judgement.reason) != bool(self.suspect)
        if judgement.reason and not self.suspect:
            self.named_after = self.pushes
        elif not judgement.reason:
            self.named_after = None
        self.suspect = judgement.reason
        return changed

    def judged_after(self) -> int:
        """The pushes it is judged on are those numbered above this: all its last ones, or, named,
        those since. Its pushes merged before took the outer momentum its way, so against that
        momentum a mix of its old and new deltas looks ordinary. Measured: a learner climbing the
        loss while reporting a low one, named by one fragment's direction (cosine +0.86 against
        the others' +0.50) and refused, pushed deltas of cosine -0.1 to +0.3 to the momentum the
        honest learners then drove; over its last 16 pushes, old and new, it stood within the
        release bar after 6 refused pushes, was un-named, and 9 more of its pushes took the
        held-out loss from 2.3 to 14 (benchmarks/hostile_learner.py --arms liar, seed 3). Its new
        pushes alone still stood apart (mean cosine 0.1 against the others' 0.45)."""
        return self.named_after or 0

    def unjudged_since_named(self) -> bool:
        """Named, with too few pushes since to judge it again."""
        return self.named_after is not None and self.pushes - self.named_after < MIN_WATCHED

    def ratio_median(self, after: int = 0) -> tuple[float, int] | None:
        """The median norm ratio of its last pushes (numbered above `after`), over every fragment:
        (median, pushes). Norms are not judged fragment by fragment: measured, an honest digits
        CNN learner's smaller fragment stood at 2.19× the others'
        (results/pusher_watch_loss_honest.json), while over all its pushes honest learners came
        to 1.35 at most."""
        figures = self.fragments.get(ALL)
        return figures.median(after) if figures is not None else None

    def loss_median(self, after: int = 0) -> float | None:
        kept = [x for n, x in self.losses if n > after]
        return statistics.median(kept) if len(kept) >= MIN_LOSSES else None

    def alignment_mean(self, fragment: int, after: int = 0) -> float | None:
        figures = self.fragments.get(fragment)
        return figures.mean(after) if figures is not None else None

    def figures(self) -> dict[str, float | None]:
        """For status: the median norm ratio and the mean alignment of its last pushes (None
        until there are MIN_WATCHED), its loss's excess as last judged, and the nearest to each
        bar so far."""

        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        ratio = self.ratio_median()
        return {
            "delta_norm_ratio": rounded(ratio[0] if ratio else None),
            "delta_alignment": rounded(self.alignment_mean(ALL)),
            "delta_norm_ratio_highest": rounded(self.highest_ratio),
            "delta_alignment_gap_largest": rounded(self.largest_gap),
            "delta_disagreement_largest": rounded(self.largest_disagreement),
            "loss_excess": rounded(self.loss_excess),
            "loss_excess_highest": rounded(self.highest_loss_excess),
        }


@dataclass(frozen=True)
class Judgement:
    reason: str  # "" when the learner's pushes look like the others'
    gap: float | None  # its mean alignment less the other learners' median (None: not judged)
    # Its median loss less the other learners', over the run's first round's loss (None: not judged).
    loss_excess: float | None = None
    # Its median cosine to the other learners' directions less theirs to one another (agreement.py),
    # furthest against them where that can be told; and its verdict per fragment.
    agreement_gap: float | None = None
    against: Mapping[int, str] = field(default_factory=dict)


def judge(
    watches: Mapping[str, PusherWatch],
    now: float,
    live_within_s: float,
    ratio_bar: float = SUSPECT_RATIO,
    gap_bar: float = SUSPECT_GAP,
    loss_bar: float = SUSPECT_LOSS,
    loss_scale: float | None = None,
    disagreement_bar: float = SUSPECT_DISAGREEMENT,
    *,
    agreement: Agreement | None = None,
) -> dict[str, Judgement]:
    """Whether each learner that pushed within `live_within_s` of `now` looks hostile or broken,
    and why: the median norm of its last pushes stands above `ratio_bar` × the others'; the mean
    cosine of its last deltas (all together, or of one fragment) to the momentum stands more than
    `gap_bar` from the median of the live learners' (at least MIN_JUDGED of them); or the median
    training loss its last pushes reported stands above the other live learners' median by more
    than `loss_bar` × `loss_scale` (the run's first round's loss; one other learner is enough: the
    higher loss is the worse one); or its direction's median cosine to the other live learners'
    stands more than `disagreement_bar` below theirs to one another (`agreement`, at least
    agreement.MIN_LEARNERS of them). A bar of 0 turns its rule off. A learner already named is
    judged on its pushes since (PusherWatch.judged_after) against RELEASE × each bar, and stays
    named until it has MIN_WATCHED of them."""
    live = {w: watch for w, watch in watches.items() if now - watch.last_at <= live_within_s}
    gaps = _direction_gaps(live)
    directions = agreement.gaps(live) if agreement is not None else {}
    losses = {w: m for w, watch in live.items() if (m := watch.loss_median(watch.judged_after())) is not None}
    out: dict[str, Judgement] = {}
    for worker, watch in live.items():
        reasons = []
        share = RELEASE if watch.suspect else 1.0
        ratio_at, gap_at, loss_at = ratio_bar * share, gap_bar * share, loss_bar * share
        excess, why = _loss_excess(worker, losses, loss_scale)
        if loss_at > 0 and excess is not None and excess > loss_at:
            reasons.append(f"{why} (above {loss_at:g})")
        ratio = watch.ratio_median(watch.judged_after())
        if ratio_at > 0 and ratio is not None and ratio[0] > ratio_at:
            reasons.append(
                f"the median norm of its last {ratio[1]} deltas is {ratio[0]:.1f}× the other "
                f"workers' (above {ratio_at:g}×)"
            )
        gap = gaps.get(worker)
        if gap is not None and gap_at > 0 and abs(gap[0]) > gap_at:
            _, fragment, mean, reference, judged = gap
            momentum = "the fragments'" if fragment == ALL else f"fragment {fragment}'s"
            reasons.append(
                f"its last deltas' mean cosine to {momentum} outer momentum is {mean:+.2f}, "
                f"the {judged} live learners' median {reference:+.2f}: it does not go their way"
            )
        mine = directions.get(worker, {})
        against = verdicts(mine, watch.against, disagreement_bar)  # its own way of letting go
        reasons.extend(why for why in against.values() if why)
        odd = told(mine)
        if not reasons and watch.suspect and watch.unjudged_since_named():
            reasons = [watch.suspect]  # too few pushes since it was named to judge it again
        out[worker] = Judgement(
            "; ".join(reasons),
            gap[0] if gap is not None else None,
            excess,
            odd.gap if odd is not None else None,
            against,
        )
    return out


def _direction_gaps(live: Mapping[str, PusherWatch]) -> dict[str, tuple[float, int, float, float, int]]:
    """Each learner's largest gap (over all its pushes, or one fragment's) between its mean cosine
    and the median of the live learners' that have one: (gap, fragment or ALL, its mean, the
    median, how many learners), where MIN_JUDGED or more have one."""
    gaps: dict[str, tuple[float, int, float, float, int]] = {}
    for fragment in sorted({p for watch in live.values() for p in watch.fragments}):
        means = {
            w: m
            for w, watch in live.items()
            if (m := watch.alignment_mean(fragment, watch.judged_after())) is not None
        }
        if len(means) < MIN_JUDGED:
            continue
        reference = statistics.median(means.values())
        for worker, mean in means.items():
            if worker not in gaps or abs(mean - reference) > abs(gaps[worker][0]):
                gaps[worker] = (mean - reference, fragment, mean, reference, len(means))
    return gaps


def _loss_excess(worker: str, losses: Mapping[str, float], scale: float | None) -> tuple[float | None, str]:
    """How far `worker`'s median reported loss stands above the other learners' median, over the
    run's first loss `scale`, and that in words; None where it cannot be told (no first loss yet,
    too few losses, no other learner)."""
    others = [m for w, m in losses.items() if w != worker]
    if worker not in losses or not others or scale is None or not 0 < scale < math.inf:
        return None, ""
    reference = statistics.median(others)
    excess = (losses[worker] - reference) / scale
    return excess, (
        f"the median training loss of its last pushes is {losses[worker]:.3g}, the other learners' "
        f"{reference:.3g}: {excess:.2f} of the run's first loss {scale:.3g} above them"
    )


def named(watches: Mapping[str, PusherWatch]) -> set[str]:
    """The learners whose pushes look hostile or broken, as last judged."""
    return {w for w, watch in watches.items() if watch.suspect}


def refused(watches: Mapping[str, PusherWatch], refuse_suspects: bool) -> set[str]:
    """The learners whose pushes are refused while they are named (with `refuse_suspects`): no
    round is for them, else a round that needs every learner would wait for them for good."""
    return named(watches) if refuse_suspects else set()


def restored(
    history: Mapping[str, Sequence[tuple[float, float | None, float | None, int, float | None]]],
    now: float,
    live_within_s: float,
    ratio_bar: float = SUSPECT_RATIO,
    gap_bar: float = SUSPECT_GAP,
    loss_bar: float = SUSPECT_LOSS,
    loss_scale: float | None = None,
    disagreement_bar: float = SUSPECT_DISAGREEMENT,
    named: Mapping[str, str] | None = None,
) -> dict[str, PusherWatch]:
    """Each learner's watch as its last pushes left it ((when, norm ratio, alignment, fragment,
    loss) each, oldest first: the ledger's), judged at `now`: a coordinator's restart neither
    forgets a learner it named nor gives it MIN_WATCHED more pushes before it is named again.
    Those `named` when it stopped (with the reason their last push was refused for) stay named,
    judged on their pushes from now on (the ledger does not tell its pushes since it was named
    from those before)."""
    named = named or {}
    watches: dict[str, PusherWatch] = {}
    for worker, pushes in history.items():
        watch = watches[worker] = PusherWatch()
        for at, ratio, alignment, fragment, loss in pushes:
            watch.add(at, ratio, alignment, fragment, loss)
        if worker in named:
            why = named[worker].removeprefix(SUSPECT_REFUSAL).lstrip(": ")
            watch.named_after, watch.suspect = watch.pushes, why or "named before the restart"
            if AGAINST in why:  # its direction is built again from its next pushes
                watch.against = {RESTORED: why}
    judged = judge(watches, now, live_within_s, ratio_bar, gap_bar, loss_bar, loss_scale, disagreement_bar)
    for worker, judgement in judged.items():
        watches[worker].take(judgement)
    return watches
