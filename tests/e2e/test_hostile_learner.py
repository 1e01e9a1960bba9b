"""A learner that climbs the loss (a flipped sign: a bug, or an attack by a learner with a valid
identity) beside two honest ones, every role a real process (diloco.testing.hostile), with the
coordinator's defaults: the pusher watch names it by the loss it reports within its first few
pushes, its pushes are refused from then on (sync.refuse_suspects), no honest learner is named, the
run ends with its token budget merged exactly once (the audit), and the model learned. Only named,
not refused, the same learner took the held-out loss from 2.18 to 35-60 (benchmarks/hostile_learner.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.coordinator.pusher_watch import MIN_LOSSES
from diloco.testing.hostile import HostileRun, run

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_learner_climbing_the_loss_is_named_and_refused_and_the_run_still_learns(
    small_corpus: Path, tmp_path: Path
) -> None:
    spec = HostileRun(tokens=400_000, timeout_s=200)  # 700 k in the benchmark: 400 k tell it here
    got = run(tmp_path / "run", small_corpus, spec)
    (climber,) = got["ascent_ids"]
    assert set(got["named"]) == {climber}, got["named"]
    assert "training loss" in got["named"][climber]
    assert not got["honest_named"]
    mine = got["learners"][climber]
    # Named once it and the others have MIN_LOSSES pushes (and the run its first loss): at the
    # earliest its MIN_LOSSES-th push is the first refused, MIN_LOSSES - 1 taken before it.
    assert mine["refused_named"] >= 1, mine
    assert MIN_LOSSES - 1 <= mine["pushes_before_refused"] <= 2 * MIN_LOSSES, mine
    honest = [v for w, v in got["learners"].items() if w != climber]
    assert len(honest) == 2 and all(v["refused_named"] == 0 and v["merged"] > 0 for v in honest), honest
    assert got["audit_ok"], got["audit_violations"]
    assert got["tokens_merged"] >= spec.tokens
    # Learned: honest learners alone end near 2.2 nats, the unigram baseline is 3.07; a climber
    # that is only named ends the run at 35-60 (and one un-named again and again, its pushes merged
    # between, ended one CI run at 3.03: pusher_watch.RELEASE).
    assert got["eval_loss"] < got["baseline_loss"] - 0.5, (got["eval_loss"], mine, got)
