"""Each learner's direction against the other learners' own (coordinator/agreement.py), and the
sketch it is read from (coordinator/delta_sample.py): real tensors, pure judgements."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.coordinator import agreement
from diloco.coordinator.agreement import (
    AGAINST_BELOW,
    LET_GO,
    MIN_PUSHES,
    MIN_REFERENCE,
    RESTORED,
    Agreement,
    AgreementGap,
    told,
    verdicts,
)
from diloco.coordinator.delta_sample import Sketcher
from diloco.coordinator.pusher_watch import (
    MIN_WATCHED,
    SUSPECT_DISAGREEMENT,
    SUSPECT_REFUSAL,
    WATCH_PUSHES,
    PusherWatch,
    judge,
    restored,
)


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[n].reshape(-1) for n in sorted(a)])
    y = torch.cat([b[n].reshape(-1) for n in sorted(b)])
    return float(x @ y / (x.norm() * y.norm()))


def test_a_sketch_reads_every_delta_of_a_fragment_at_the_same_entries_and_keeps_its_cosine() -> None:
    g = torch.Generator().manual_seed(0)
    way = {"w": torch.randn(2_000_000, generator=g), "b": torch.randn(300, generator=g)}
    a = {n: t + 2 * torch.randn(t.shape, generator=g) for n, t in way.items()}
    b = {n: t + 2 * torch.randn(t.shape, generator=g) for n, t in way.items()}
    sketcher = Sketcher()
    sa, sb = sketcher.sketch(0, a), sketcher.sketch(0, b)
    assert sa is not None and sb is not None and sa.size == sketcher.entries
    assert float(np.dot(sa, sb)) == pytest.approx(cosine(a, b), abs=0.02)
    assert float(np.linalg.norm(sa)) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(sketcher.sketch(0, a), sa)  # the same entries for the fragment's life
    other = Sketcher()  # another coordinator's life: other entries, that no pusher can know
    assert not np.array_equal(other.sketch(0, a), sa)


def test_a_small_fragment_is_read_whole_and_a_zero_or_foreign_delta_gives_no_sketch() -> None:
    sketcher = Sketcher()
    delta = {"w": torch.tensor([3.0, 0.0]), "bn.running_mean": torch.tensor([9.0]), "b": torch.tensor([4.0])}
    got = sketcher.sketch(1, delta, skip={"bn.running_mean"})
    assert got is not None and got.tolist() == pytest.approx([0.8, 0.6, 0.0])  # b, then w: by name
    assert sketcher.sketch(1, {"w": torch.zeros(2), "b": torch.zeros(1)}) is None
    assert sketcher.sketch(1, {"w": torch.ones(2)}) is None  # not the fragment's tensors


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x)).astype(np.float32)


def directions(pushes: int, against: int = 1, honest: int = 2, seed: int = 0, noise: int = 0) -> Agreement:
    """`honest` learners whose sketches share one way under noise, then `against` learners whose
    sketches point the other way, then `noise` learners whose sketches are noise alone."""
    rng = np.random.default_rng(seed)
    way = rng.standard_normal(4096)
    seen = Agreement()
    for _ in range(pushes):
        for k in range(honest + against + noise):
            sign = 1.0 if k < honest else -1.0 if k < honest + against else 0.0
            seen.add(f"l{k}", 0, unit(sign * way + 1.5 * rng.standard_normal(4096)))
    return seen


def test_the_learner_that_goes_against_every_other_one_stands_out_and_the_honest_do_not() -> None:
    seen = directions(pushes=4)
    gaps = seen.gaps({"l0", "l1", "l2"})
    odd, honest = gaps["l2"][0], [gaps["l0"][0], gaps["l1"][0]]
    # The honest two agree (+0.4 or so); the odd one goes against both: its gap is both cosines.
    assert odd.cosine < -0.2 and odd.reference > 0.2 and odd.gap < -0.5, odd
    assert all(g.gap > 0 for g in honest), honest  # against the pair it is in: above it
    assert odd.learners == 3 and set(gaps["l2"]) == {0}  # one fragment


def test_nothing_is_judged_among_two_learners_or_before_each_has_pushed_enough() -> None:
    assert directions(pushes=4, against=1, honest=1).gaps({"l0", "l1"}) == {}
    assert directions(pushes=MIN_PUSHES - 1).gaps({"l0", "l1", "l2"}) == {}
    assert directions(pushes=4).gaps({"l0", "l1"}) == {}  # the third not live


def test_honest_learners_alone_stand_near_one_another() -> None:
    gaps = directions(pushes=6, against=0, honest=6).gaps({f"l{k}" for k in range(6)})
    assert max(abs(g[0].gap) for g in gaps.values()) < 0.1, gaps


def test_the_least_recently_pushed_direction_is_let_go_beyond_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agreement, "MAX_LEARNERS", 3)
    seen = directions(pushes=2, against=0, honest=4)
    assert list(seen.ways[0]) == ["l1", "l2", "l3"]
    assert all("l0" not in pair for pair in seen.cosines[0])


def test_judge_names_the_learner_against_the_others_and_lets_it_go_only_once_it_goes_their_way() -> None:
    seen = directions(pushes=4)
    watches = {f"l{k}": PusherWatch(last_at=100.0) for k in range(3)}
    got = judge(watches, now=100.0, live_within_s=60.0, agreement=seen)
    assert got["l0"].reason == got["l1"].reason == ""
    assert "go against the other learners'" in got["l2"].reason, got["l2"]
    assert got["l2"].agreement_gap is not None and got["l2"].agreement_gap < -SUSPECT_DISAGREEMENT
    assert judge(watches, 100.0, 60.0, disagreement_bar=0, agreement=seen)["l2"].reason == ""  # rule off
    assert watches["l2"].take(got["l2"]) and watches["l2"].figures()["delta_disagreement_largest"] > 0.5
    watches["l2"].pushes += MIN_WATCHED  # pushes since it was named: judged again, not carried
    # Named, pushing noise: near 0 to the others, less apart than the bar, and still named.
    lukewarm = directions(pushes=4, against=0, honest=2, noise=1)
    gap = lukewarm.gaps(set(watches))["l2"][0]
    assert -gap.gap < SUSPECT_DISAGREEMENT and gap.cosine < LET_GO * gap.reference, gap
    assert "go against" in judge(watches, 100.0, 60.0, agreement=lukewarm)["l2"].reason
    assert judge({"l2": PusherWatch(last_at=100.0), "l0": watches["l0"], "l1": watches["l1"]},
                 100.0, 60.0, agreement=lukewarm)["l2"].reason == ""  # fmt: skip # never named: not named for it
    # Going the others' way again, it is let go.
    assert judge(watches, 100.0, 60.0, agreement=directions(pushes=4, against=0, honest=3))["l2"].reason == ""


def test_where_the_others_do_not_agree_enough_to_tell_a_fragments_last_verdict_stands() -> None:
    # Late in a run honest deltas are mostly noise: their cosines to one another near 0, and a
    # learner's near 0 to them says nothing either way.
    against = AgreementGap(-1.0, -0.4, 0.6, 3)
    assert "go against" in verdicts({0: against}, {}, bar=0.7)[0]
    quiet = AgreementGap(-0.1, 0.0, MIN_REFERENCE / 2, 3)
    assert verdicts({0: quiet}, {0: "named before"}, bar=0.7) == {0: "named before"}
    assert verdicts({0: quiet}, {}, bar=0.7) == {0: ""}
    # Far below the others but still their way (a slower learner's older start): not named.
    assert verdicts({0: AgreementGap(-0.8, AGAINST_BELOW + 0.2, 0.9, 3)}, {}, bar=0.7) == {0: ""}
    agrees = AgreementGap(-0.1, 0.5, 0.6, 3)  # told, and like the others: let go
    assert verdicts({0: agrees}, {0: "named before"}, bar=0.7) == {0: ""}
    # A fragment not compared now keeps its verdict; a bar of 0 gives none.
    assert verdicts({1: agrees}, {0: "named before"}, bar=0.7) == {0: "named before", 1: ""}
    assert verdicts({0: against}, {0: "named before"}, bar=0) == {}
    assert told({0: quiet, 1: agrees}) == agrees and told({0: quiet}) is None


def test_a_learner_named_for_its_direction_before_a_restart_stays_named_until_its_direction_is_told() -> None:
    # The directions live in memory: after a restart they are built again from the next pushes,
    # and until one of its fragments' can be told the naming stands.
    why = "its recent deltas of fragment 1 go against the other learners': median cosine -0.40"
    history = {w: [(90.0, 1.0, 0.5, 0, None)] * WATCH_PUSHES for w in ("l0", "l1", "l2")}
    watches = restored(history, now=100.0, live_within_s=60.0, named={"l2": f"{SUSPECT_REFUSAL}: {why}"})
    assert watches["l2"].suspect == why and watches["l2"].against == {RESTORED: why}
    for watch in watches.values():  # pushes since the restart enough to judge it again
        for _ in range(MIN_WATCHED):
            watch.add(100.0, 1.0, 0.5)
    assert judge(watches, 100.0, 60.0, agreement=Agreement())["l2"].reason == why  # nothing told yet
    # Told, and near 0 to the others (less apart than the bar): judged as named, not afresh.
    lukewarm = directions(pushes=4, against=0, honest=2, noise=1)
    assert "go against" in judge(watches, 100.0, 60.0, agreement=lukewarm)["l2"].reason
    got = judge(watches, 100.0, 60.0, agreement=directions(pushes=4, against=0, honest=3))
    assert got["l2"].reason == "" and got["l2"].against == {0: ""}  # told, and like the others
