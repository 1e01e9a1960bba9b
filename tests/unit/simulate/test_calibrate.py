"""A run's costs read back from its workdir, and the configs that replay it or scale it up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.simulate import SimConfig, simulate
from diloco.simulate.calibrate import read_calibration, replay_config, scaled_config
from tests.unit.simulate.conftest import T0, done


def test_the_run_dir_gives_restarts_kills_losses_and_wire_costs(run_dir: Path) -> None:
    cal = read_calibration(run_dir)
    assert cal.learners == 2 and cal.wall_s == 100.0
    assert cal.job_startup_s == 10.0
    assert cal.wind_down_s == pytest.approx(2.0, abs=0.01)
    assert cal.restarts == 1
    assert cal.kill_times == pytest.approx((41.0,), abs=0.01)
    assert cal.kill_units == (0,)
    assert cal.restart_total_s == pytest.approx(2.0) and cal.pull_s == pytest.approx(0.2)
    assert cal.lost_per_kill_s == pytest.approx(1.0, abs=0.01)  # 1.5 s old, resumed 0.5 s after the kill
    assert cal.step_efficiency == pytest.approx(
        (54 + 87) / (55.5 + 94.0), abs=1e-3
    )  # busy over the loops' walls
    # learner-0's last life resumed at step 100: its done line's 200 steps count from 0, its busy
    # time from the resume.
    assert cal.step_s == pytest.approx((54 + 87) / (100 + 300))
    assert cal.coordinator_kills == pytest.approx((60.0,), abs=0.01)
    assert cal.coordinator_restart_s == pytest.approx(2.5, abs=0.01)  # its metrics.jsonl start event
    assert cal.merge_s == pytest.approx(0.02)
    assert cal.bits_per_param == pytest.approx(2000 * 8 / 500)
    assert (cal.fragments, cal.inner_steps, cal.codec) == (2, 50, "fp32")


def test_the_supervisors_kill_log_gives_kills_no_log_line_shows(run_dir: Path) -> None:
    """A kill during a life's start-up leaves no start-up line: the summary's kill_log (what
    `diloco run` records) is the kill times' source when it is there."""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["started_at"] = T0
    summary["kill_log"] = [
        {"at": T0 + 5.0, "process": "learner-1", "role": "learner"},  # before its first step
        {"at": T0 + 41.0, "process": "learner-0", "role": "learner"},
        {"at": T0 + 60.0, "process": "coordinator", "role": "coordinator"},
    ]
    summary_path.write_text(json.dumps(summary))
    cal = read_calibration(run_dir)
    assert cal.kill_times == pytest.approx((5.0, 41.0)) and cal.kill_units == (1, 0)
    assert cal.coordinator_kills == pytest.approx((60.0,))
    assert cal.restarts == 1  # the restart phases still come from the lives that logged them


def test_a_life_that_ends_before_its_first_step_keeps_its_end_to_itself(run_dir: Path) -> None:
    """Killed in the run's wind-down, learner-1 comes back to a finishing run and logs its end
    with no step taken. That end is its own (matched by pid), not the killed life's before it."""
    before = read_calibration(run_dir)
    log = run_dir / "logs" / "learner-1.log"
    log.write_text(log.read_text() + done(99.0, 14, busy=0.0, wall=0.3, steps=300) + "\n")
    after = read_calibration(run_dir)
    assert after.step_efficiency == pytest.approx(before.step_efficiency)
    assert after.step_s == pytest.approx(before.step_s)


def test_the_final_flush_is_wind_down_not_a_loss_on_every_step(run_dir: Path) -> None:
    """learner-1 steps from 10 s and its loop's own wall is 25 s, but its end line comes at 98 s:
    63 s after its loop ended went to the run's last pushes and their merge. That time is the
    run's end, once: it goes to the wind-down, and the share of a loop spent in steps stays busy
    over the loop's wall."""
    log = run_dir / "logs" / "learner-1.log"
    log.write_text(log.read_text().replace("busy=87.0s wall=94.0s", "busy=24.5s wall=25.0s"))
    cal = read_calibration(run_dir)
    assert cal.step_efficiency == pytest.approx((54 + 24.5) / (55.5 + 25.0), abs=1e-3)
    # Mean of the two lives' flushes (learner-0: 98 - 43 - 55.5 < 0, none; learner-1: 88 - 25 = 63 s),
    # on top of the 2 s from the end lines to the run's end.
    assert cal.wind_down_s == pytest.approx(2.0 + 63.0 / 2, abs=0.01)


def test_the_replay_predicts_the_summarys_goodput_by_hand(run_dir: Path) -> None:
    cal = read_calibration(run_dir)
    r = simulate(replay_config(cal), "decoupled")
    # learner-0 steps 10..41 and loses the 1 s since its last state (saved every 2 s of its life),
    # restarts in 2 s, steps 43..98; learner-1 steps 10..98. The coordinator's 2.5 s down stops
    # nobody.
    kept = (31 - 1) + (98 - 43) + (98 - 10)
    assert r.goodput == pytest.approx(kept * cal.step_efficiency / 200, abs=0.005)
    assert r.failures == 1
    assert r.decisions.get("coordinator-restart") == 1
    poisson = simulate(replay_config(cal, seed=1, kill_every_s=60.0), "decoupled")
    assert 0 < poisson.goodput < 1


def test_scaling_keeps_measured_parts_and_the_stated_assumptions(run_dir: Path) -> None:
    cal = read_calibration(run_dir)
    base = SimConfig()
    scaled = scaled_config(cal, base)
    assert scaled.link.params == base.link.params and scaled.recovery.restart_s == base.recovery.restart_s
    assert scaled.recovery.startup_s == pytest.approx(2.0 - 0.2)  # software start-up, the pull aside
    assert scaled.step_efficiency == pytest.approx(cal.step_efficiency)
    assert scaled.link.bits_per_param is None  # measured on fp32, the job sends int4
    same_codec = scaled_config(cal, SimConfig().with_(link=base.link.__class__(codec="fp32")))
    assert same_codec.link.bits_per_param == pytest.approx(cal.bits_per_param)


def test_a_dir_without_a_summary_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="summary.json"):
        read_calibration(tmp_path)


def test_a_resumed_runs_summary_without_a_goodput_still_calibrates(run_dir: Path) -> None:
    """A resumed job's goodput is null (its busy seconds hold earlier jobs'): tune, simulate
    --calibrate and run --auto once failed on it with a TypeError."""
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(
        json.dumps({**summary, "goodput": None, "goodput_after_start": None})
    )
    cal = read_calibration(run_dir)
    assert cal.goodput == 0.0 and cal.goodput_after_start == 0.0 and cal.learners == 2
