"""Two runs compared after every merge at matched merged tokens (benchmarks/merge_evals.py): the
staircase of the global model's loss, not the last merge alone."""

from __future__ import annotations

import pytest

from benchmarks.merge_evals import matched_gap


def stairs(*points: tuple[float, float]) -> list[dict[str, float]]:
    return [{"tokens": t, "loss": loss} for t, loss in points]


def test_a_twin_whose_last_merge_came_at_the_very_end_is_not_the_whole_story():
    # The twin's last merge (at 1.0) took its loss down 2% at once; the run's last merges came
    # earlier and smaller. At the end the run is 2% behind, but over the last half it is level
    # with the twin most of the way.
    twin = stairs((0.2, 3.0), (0.5, 2.5), (0.7, 2.4), (1.0, 2.352))
    run = stairs((0.2, 3.0), (0.5, 2.5), (0.7, 2.4), (0.95, 2.4), (1.0, 2.4))
    gap = matched_gap(twin, run)
    assert gap["final"] == pytest.approx(2.4 / 2.352 - 1)
    assert gap["worst"] == pytest.approx(gap["final"])
    assert 0 < gap["mean"] < 0.1 * gap["final"]  # one point of 201 is behind
    assert gap["best"] == pytest.approx(0.0)


def test_a_run_behind_at_every_point_shows_it_in_the_mean():
    twin = stairs((0.5, 2.5), (1.0, 2.3))
    run = stairs((0.5, 2.55), (1.0, 2.346))
    gap = matched_gap(twin, run)
    assert gap["mean"] == pytest.approx(0.02, abs=1e-3)
    assert gap["best"] == pytest.approx(0.02, abs=1e-3)


def test_merges_without_a_kept_file_are_skipped_and_none_at_all_is_an_error():
    twin = stairs((0.5, 2.5), (1.0, 2.3))
    run = [{"tokens": 0.5, "loss": None}, {"tokens": 1.0, "loss": 2.3}]
    assert matched_gap(twin, run)["final"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="keep_versions"):
        matched_gap(twin, [{"tokens": 1.0, "loss": None}])
