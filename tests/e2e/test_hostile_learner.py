"""A learner that climbs the loss (a flipped sign: a bug, or an attack by a learner with a valid
identity) and reports the lowest loss it has seen (so the loss rule sees nothing), beside two honest
ones, every role a real process (diloco.testing.hostile), with the coordinator's defaults: the
pusher watch names it by its direction against the other learners' own (coordinator/agreement.py)
within its first few pushes, its pushes are refused from then on (sync.refuse_suspects), no honest
learner is named, the run ends with its token budget merged exactly once (the audit), and the model
learned. Judged against the outer momentum only, the same liar was never named in one seed of
three, and the held-out loss ended at 19.8 (benchmarks/hostile_learner.py --arms liar)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.coordinator.agreement import AGAINST, MIN_PUSHES
from diloco.testing.hostile import HostileRun, run

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_learner_climbing_the_loss_and_lying_about_it_is_named_and_refused_and_the_run_still_learns(
    small_corpus: Path, tmp_path: Path
) -> None:
    spec = HostileRun(tokens=400_000, timeout_s=200, lie=True)  # 700 k in the benchmark: 400 k tell it here
    got = run(tmp_path / "run", small_corpus, spec)
    (climber,) = got["ascent_ids"]
    assert set(got["named"]) == {climber}, got["named"]
    assert AGAINST in got["named"][climber], got["named"]
    assert not got["honest_named"]
    mine = got["learners"][climber]
    # Named once it and the others have MIN_PUSHES pushes of a fragment: at the earliest its
    # MIN_PUSHES-th push is the first refused, MIN_PUSHES - 1 taken before it (two fragments).
    assert mine["refused_named"] >= 1, mine
    assert MIN_PUSHES - 1 <= mine["pushes_before_refused"] <= 4 * MIN_PUSHES, mine
    honest = [v for w, v in got["learners"].items() if w != climber]
    assert len(honest) == 2 and all(v["refused_named"] == 0 and v["merged"] > 0 for v in honest), honest
    assert got["audit_ok"], got["audit_violations"]
    assert got["tokens_merged"] >= spec.tokens
    # Learned: honest learners alone end near 2.2 nats, the unigram baseline is 3.07; a climber
    # that is only named ends the run at 35-60.
    assert got["eval_loss"] < got["baseline_loss"] - 0.5, (got["eval_loss"], mine, got)
