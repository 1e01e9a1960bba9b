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
