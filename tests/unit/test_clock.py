"""A condition's duration, timed by moving timestamps (diloco.clock)."""

from __future__ import annotations

from diloco.clock import lasting


def test_a_condition_is_timed_from_its_first_sighting_and_the_count_restarts_once_it_ends() -> None:
    assert lasting(False, None, 5.0) == (None, 0.0)
    since, lasted = lasting(True, None, 10.0)
    assert (since, lasted) == (10.0, 0.0)
    assert lasting(True, since, 14.5) == (10.0, 4.5)
    assert lasting(False, since, 15.1) == (None, 0.0)  # e.g. a shard came
    assert lasting(True, None, 16.0) == (16.0, 0.0)
