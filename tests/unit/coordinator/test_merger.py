"""The merger's sleep: until the earliest grace window runs out, never longer than its poll."""

import pytest

from diloco.coordinator.service.merger import wake_in


def test_with_no_window_open_the_merger_polls():
    assert wake_in(100.0, None, 0.25) == 0.25


def test_a_window_that_ends_sooner_than_the_poll_wakes_the_merger_then():
    assert wake_in(100.0, 100.1, 0.25) == pytest.approx(0.1)
    assert wake_in(100.0, 107.0, 0.25) == 0.25


def test_a_window_already_over_wakes_it_at_once_without_spinning():
    assert 0 < wake_in(100.0, 99.0, 0.25) <= 0.01


def test_the_syncers_timings_are_moving_averages_that_start_at_the_first_sample():
    from diloco.coordinator.service.state import moving_average

    assert moving_average(0.0, 3.0) == 3.0
    assert moving_average(1.0, 2.0) == pytest.approx(1.2)
