"""Whole runs of each mode: seeded, sane at the edges, and ordered as the model says."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from diloco.simulate import MODES, FailureConfig, RecoveryConfig, SimConfig, simulate
from diloco.simulate.costs import expected_max_lognormal, sync_times
from diloco.simulate.failures import SparePool, chip_failures

NO_FAILURES = FailureConfig(mtbi_years=1e9)
SMALL = SimConfig(chips=20_000, learners=4, hours=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_run_other_seed_other_run(mode: str) -> None:
    cfg = SMALL.with_(chips=200_000, seed=3)
    assert simulate(cfg, mode) == simulate(cfg, mode)
    assert simulate(cfg, mode).goodput != simulate(cfg.with_(seed=4), mode).goodput


def test_without_failures_goodput_is_one_less_the_sync_overhead() -> None:
    cfg = SMALL.with_(failure=NO_FAILURES, dp_exposed_comm_s=0.5)
    assert simulate(cfg, "dp").goodput == pytest.approx(2.0 / 2.5, abs=1e-3)
    assert simulate(cfg, "elastic-dp").goodput == pytest.approx(2.0 / 2.5, abs=1e-3)
    assert simulate(cfg, "decoupled").goodput == pytest.approx(1.0, abs=1e-6)
    sync = sync_times(cfg.link, cfg.outer, cfg.step_s)
    compute = cfg.outer.inner_steps * cfg.step_s
    expected = compute / (compute + sync.sync_blocking_s)
    assert simulate(cfg, "sync-diloco").goodput == pytest.approx(expected, abs=0.01)
    for mode in MODES:
        r = simulate(cfg, mode)
        assert r.failures == 0 and r.wasted == 0.0


@pytest.mark.parametrize("mtbi", [0.05, 1.0])
def test_goodput_is_a_share_and_decoupled_beats_dp_when_failures_are_frequent(mtbi: float) -> None:
    cfg = SMALL.with_(chips=600_000, learners=8, hours=1.0, failure=FailureConfig(mtbi_years=mtbi))
    results = {mode: simulate(cfg, mode) for mode in MODES}
    for r in results.values():
        assert 0.0 <= r.goodput <= 1.0 and 0.0 <= r.uptime <= 1.0 and 0.0 <= r.wasted <= 1.0
        assert r.goodput + r.wasted <= 1.0 + 1e-9
    assert results["decoupled"].goodput > results["elastic-dp"].goodput > results["dp"].goodput
    assert results["decoupled"].goodput > results["sync-diloco"].goodput
    assert results["decoupled"].uptime > results["dp"].uptime


def test_more_learners_more_goodput_and_dp_falls_with_scale() -> None:
    cfg = SimConfig(hours=4.0)
    dp = [simulate(cfg.with_(chips=n), "dp").goodput for n in (150_000, 600_000, 2_400_000)]
    assert dp[0] > dp[1] > dp[2]
    dec = [simulate(cfg.with_(chips=2_400_000, learners=m), "decoupled").goodput for m in (2, 8, 16)]
    assert dec[0] < dec[1] < dec[2]


def test_dp_goodput_follows_the_poisson_arithmetic() -> None:
    # With a restart that starts again on every failure, the job steps while no failure came in
    # the last restart_s: a share exp(-rate * restart_s) of the time.
    cfg = SimConfig(chips=300_000, hours=48.0, recovery=RecoveryConfig(restart_s=30.0))
    rate = cfg.chips / (cfg.failure.mtbi_years * 365.25 * 24 * 3600)
    assert simulate(cfg, "dp").uptime == pytest.approx(np.exp(-rate * 30.0), abs=0.02)


def test_a_coordinator_down_past_the_bound_stops_the_learners() -> None:
    base = SMALL.with_(failure=NO_FAILURES)
    quick = replace(base, failure=replace(NO_FAILURES, coordinator_trace=(1000.0,)),
                    recovery=RecoveryConfig(coordinator_restart_s=60.0))  # fmt: skip
    r = simulate(quick, "decoupled")
    assert r.goodput == pytest.approx(1.0, abs=1e-6)  # 60 s < the 300 s bound: nobody stops
    assert r.merge_halted == pytest.approx(60.0 / 7200.0, abs=1e-4)
    slow = replace(quick, recovery=RecoveryConfig(coordinator_restart_s=900.0))
    r = simulate(slow, "decoupled")
    assert r.goodput == pytest.approx(1.0 - 600.0 / 7200.0, abs=1e-3)  # stopped from 300 s to 900 s
    assert r.decisions["stop-at-halt-bound"] == 1


def test_a_trace_replays_exactly_those_failures() -> None:
    trace = FailureConfig(trace=(100.0, 200.0, 5000.0, 9e9), trace_units=(0, 1, 0, 0))
    r = simulate(SMALL.with_(failure=trace), "decoupled")
    assert r.failures == 3  # the one past the horizon never happens
    assert r.decisions == {"restart": 3}


def test_weibull_slices_fail_at_the_same_mean_rate() -> None:
    rng = np.random.default_rng(0)
    for shape in (0.7, 1.5):
        fails = chip_failures(FailureConfig(mtbi_years=0.01, weibull_shape=shape), chips=10_000, slices=100,
                              units=4, horizon_s=24 * 3600, rng=rng)  # fmt: skip
        expected = 10_000 * 24 * 3600 / (0.01 * 365.25 * 24 * 3600)
        assert len(fails) == pytest.approx(expected, rel=0.15)
        assert np.all(np.diff(fails.times) >= 0) and set(np.unique(fails.units)) <= {0, 1, 2, 3}


def test_without_spares_a_restart_waits_for_a_repair() -> None:
    pool = SparePool(free=1, repair_s=100.0)
    assert pool.take(0.0) == 0.0  # the spare
    assert pool.take(10.0) == 100.0  # none left: the first failed slice is back at 100
    assert pool.take(150.0) == 150.0  # the first repaired slice is free again
    unlimited = SimConfig(chips=200_000, hours=2.0)
    bounded = replace(unlimited, recovery=RecoveryConfig(spares=0, repair_s=1800.0))
    assert simulate(bounded, "dp").goodput < 0.5 * simulate(unlimited, "dp").goodput


def test_a_slow_learner_costs_synchronous_diloco_more_than_decoupled() -> None:
    from diloco.simulate import StragglerConfig

    cfg = SMALL.with_(failure=NO_FAILURES, straggler=StragglerConfig(slow_share=0.25, slow_factor=2.0))
    assert simulate(cfg, "decoupled").goodput == pytest.approx(0.875, abs=1e-3)  # 3 at full pace, 1 at half
    assert simulate(cfg, "sync-diloco").goodput < 0.6  # everyone at the slow one's pace
    assert expected_max_lognormal(1, 0.0) == 1.0
    assert 1.0 < expected_max_lognormal(2, 0.1) < expected_max_lognormal(1000, 0.1) < 1.5
