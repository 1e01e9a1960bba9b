"""Each learner's recent deltas against the others': how large (over the outlier check's median of
the other workers' norms) and which way (cosine to the fragment's outer momentum, beside the other
learners' cosines), and the pure decision that a learner's pushes look hostile or broken, with its
reason.

A norm bound limits how far one push moves the model, not where to: within it an authenticated
learner can wreck a run (README, "Who may talk to the coordinator"), and so can a broken one (a
faulty GPU, corrupt data) whose deltas are finite. One push says little (an honest delta can stand
at 4× the median); a learner's last pushes together tell it apart. The coordinator says so (status,
Prometheus, one log line when it changes); cutting the learner off is the operator's call
(`diloco certs revoke`), or with `sync.refuse_suspects` its pushes are refused while it is named.

Direction is judged against the other learners, not against the momentum alone: a learner that
pushes more than the others takes the momentum with it, and then the honest learners' deltas are
the ones that point against it (measured: benchmarks/outer_sim.py --hostile). What stands out is
the learner whose cosine is not the others': far from the median of every live learner's (its own
included, so that with three learners one odd one cannot move it). With fewer than three nothing
says which is the odd one, and no direction is judged.
"""

from __future__ import annotations

import collections
import math
import random
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

WATCH_PUSHES = 16  # a learner's last pushes the figures are over
MIN_WATCHED = 6  # fewer say nothing yet
MIN_JUDGED = 3  # direction is judged among at least this many live learners' figures
# The bars (benchmarks/pusher_watch.py, results/pusher_watch.json): honest learners came to 1.35
# and 0.16 at most (GPT at H = 10 and 20, a 3× slower learner, int8, synchronous, kills under
# chaos, the digits CNN); one learner of three pushing its delta reversed at 1 to 9.9× the others'
# median stood 0.40 to 1.30 from the others' cosine (0.85 and more below 2×), and 1 to 9.9 in norm.
# Their defaults (config: sync.suspect_norm_ratio, sync.suspect_alignment_gap):
SUSPECT_RATIO = 2.0  # the median of a learner's last norm ratios above this
SUSPECT_GAP = 0.35  # its mean cosine to the momentum this far from the live learners' median
# The cosine's sample (alignment): tensors up to SAMPLE_ALL entries whole, larger ones in
# SAMPLE_BLOCKS blocks that together hold 1/SAMPLE_SHARE of them.
SAMPLE_ALL = 1 << 16
SAMPLE_BLOCKS = 4
SAMPLE_SHARE = 8
# How a push is refused while its learner is named (sync.refuse_suspects), before the reason.
SUSPECT_REFUSAL = "its learner looks hostile or broken (sync.refuse_suspects)"
# A learner's figures in status (PusherWatch.figures) that a run's summary keeps.
WATCH_FIGURES = (
    "delta_norm_ratio",
    "delta_alignment",
    "delta_norm_ratio_highest",
    "delta_alignment_gap_largest",
)


@dataclass
class PusherWatch:
    """One learner's last pushes: each one's norm ratio and alignment (None: not known for it)."""

    ratios: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=WATCH_PUSHES))
    alignments: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=WATCH_PUSHES)
    )
    last_at: float = 0.0  # when it last pushed (the service's clock)
    suspect: str = ""  # the reason last decided ("": none); the service logs when it comes and goes
    # The nearest the learner came to each bar in this coordinator's life: how much room an
    # honest one leaves.
    highest_ratio: float | None = None
    largest_gap: float | None = None
    # Kept as pushes come (None until MIN_WATCHED): every push judges every live learner.
    _median: float | None = None
    _mean: float | None = None

    def add(self, now: float, ratio: float | None, alignment: float | None) -> None:
        self.last_at = now
        if ratio is not None and math.isfinite(ratio):
            self.ratios.append(ratio)
            if len(self.ratios) >= MIN_WATCHED:
                self._median = statistics.median(self.ratios)
                self.highest_ratio = max(self.highest_ratio or 0.0, self._median)
        if alignment is not None and math.isfinite(alignment):
            self.alignments.append(alignment)
            if len(self.alignments) >= MIN_WATCHED:
                self._mean = statistics.fmean(self.alignments)

    def take(self, judgement: Judgement) -> bool:
        """A judgement of this learner: its reason kept, its gap in the largest so far. True when
        it came to look hostile or broken, or no longer does (its figures move push by push)."""
        if judgement.gap is not None:
            self.largest_gap = max(self.largest_gap or 0.0, abs(judgement.gap))
        changed = bool(judgement.reason) != bool(self.suspect)
        self.suspect = judgement.reason
        return changed

    def ratio_median(self) -> float | None:
        return self._median

    def alignment_mean(self) -> float | None:
        return self._mean

    def figures(self) -> dict[str, float | None]:
        """For status: the median norm ratio and the mean alignment of the last pushes (None
        until there are MIN_WATCHED), and the nearest to each bar so far."""

        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {
            "delta_norm_ratio": rounded(self.ratio_median()),
            "delta_alignment": rounded(self.alignment_mean()),
            "delta_norm_ratio_highest": rounded(self.highest_ratio),
            "delta_alignment_gap_largest": rounded(self.largest_gap),
        }


def alignment(
    delta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    skip: Collection[str] = (),
    rng: random.Random | None = None,
) -> float | None:
    """The cosine between a delta and the fragment's outer momentum, over the tensors of both but
    `skip` (running statistics come as values); None while the momentum is zero (no merge yet).

    Over a sample: of each tensor larger than SAMPLE_ALL entries, SAMPLE_BLOCKS contiguous blocks
    of 1/(SAMPLE_BLOCKS · SAMPLE_SHARE) of it at offsets `rng` draws per push (a pusher cannot
    know which), so the watch reads an eighth of the delta and of the momentum. Over every entry it
    cost 12% of the coordinator's CPU per pushed MB (benchmarks/ingest.py: +0.23 ms/MB on 1.9);
    the sample 0.03 ms/MB (a 49 MB fragment in 1.5 ms), within 0.01 of the whole cosine."""
    rng = rng or random.Random()
    along = delta_sq = momentum_sq = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for name in (n for n in delta if n in momentum and n not in skip):
            d, m = flat_values(delta[name]), flat_values(momentum[name])
            for start, stop in sampled(d.size, rng):
                x, y = d[start:stop], m[start:stop]
                along += float(np.dot(x, y))
                delta_sq += float(np.dot(x, x))
                momentum_sq += float(np.dot(y, y))
    if not (0 < delta_sq < math.inf and 0 < momentum_sq < math.inf and math.isfinite(along)):
        return None
    return along / math.sqrt(delta_sq * momentum_sq)


def flat_values(t: torch.Tensor) -> np.ndarray:
    """A tensor's entries as one flat fp32 array (a view where it already is one). numpy, as
    wire.tensors.sq_norm: torch's reductions start an OpenMP team per gRPC handler thread."""
    flat = t.detach().reshape(-1)
    return (flat if flat.dtype == torch.float32 else flat.float()).numpy()


def sampled(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """The [start, stop) spans of a flat tensor the cosine reads: all of a small one, else
    SAMPLE_BLOCKS blocks at random offsets."""
    if size <= SAMPLE_ALL:
        return [(0, size)]
    block = size // (SAMPLE_BLOCKS * SAMPLE_SHARE)
    return [(s, s + block) for s in (rng.randrange(size - block + 1) for _ in range(SAMPLE_BLOCKS))]


@dataclass(frozen=True)
class Judgement:
    reason: str  # "" when the learner's pushes look like the others'
    gap: float | None  # its mean alignment less the other learners' median (None: not judged)


def judge(
    watches: Mapping[str, PusherWatch],
    now: float,
    live_within_s: float,
    ratio_bar: float = SUSPECT_RATIO,
    gap_bar: float = SUSPECT_GAP,
) -> dict[str, Judgement]:
    """Whether each learner that pushed within `live_within_s` of `now` looks hostile or broken,
    and why: the median norm of its last pushes stands above `ratio_bar` × the others', or the
    mean cosine of its last deltas to the momentum stands more than `gap_bar` from the median of
    the live learners' (at least MIN_JUDGED of them). A bar of 0 turns its rule off."""
    live = {w: watch for w, watch in watches.items() if now - watch.last_at <= live_within_s}
    means = {w: m for w, watch in live.items() if (m := watch.alignment_mean()) is not None}
    reference = statistics.median(means.values()) if len(means) >= MIN_JUDGED else None
    out: dict[str, Judgement] = {}
    for worker, watch in live.items():
        reasons = []
        if ratio_bar > 0 and (median := watch.ratio_median()) is not None and median > ratio_bar:
            reasons.append(
                f"the median norm of its last {len(watch.ratios)} deltas is {median:.1f}× the other "
                f"workers' (above {ratio_bar:g}×)"
            )
        gap = None
        if worker in means and reference is not None:
            gap = means[worker] - reference
            if gap_bar > 0 and abs(gap) > gap_bar:
                reasons.append(
                    f"its last deltas' mean cosine to the fragments' outer momentum is {means[worker]:+.2f}, "
                    f"the {len(means)} live learners' median {reference:+.2f}: it does not go their way"
                )
        out[worker] = Judgement("; ".join(reasons), gap)
    return out


def named(watches: Mapping[str, PusherWatch]) -> set[str]:
    """The learners whose pushes look hostile or broken, as last judged."""
    return {w for w, watch in watches.items() if watch.suspect}


def refused(watches: Mapping[str, PusherWatch], refuse_suspects: bool) -> set[str]:
    """The learners whose pushes are refused while they are named (with `refuse_suspects`): no
    round is for them, else a round that needs every learner would wait for them for good."""
    return named(watches) if refuse_suspects else set()


def restored(
    history: Mapping[str, Sequence[tuple[float, float | None, float | None]]],
    now: float,
    live_within_s: float,
    ratio_bar: float = SUSPECT_RATIO,
    gap_bar: float = SUSPECT_GAP,
) -> dict[str, PusherWatch]:
    """Each learner's watch as its last pushes left it ((when, norm ratio, alignment) each, oldest
    first: the ledger's), judged at `now`: a coordinator's restart neither forgets a learner it
    named nor gives it MIN_WATCHED more pushes before it is named again."""
    watches: dict[str, PusherWatch] = {}
    for worker, pushes in history.items():
        watch = watches[worker] = PusherWatch()
        for at, ratio, alignment in pushes:
            watch.add(at, ratio, alignment)
    for worker, judgement in judge(watches, now, live_within_s, ratio_bar, gap_bar).items():
        watches[worker].take(judgement)
    return watches
