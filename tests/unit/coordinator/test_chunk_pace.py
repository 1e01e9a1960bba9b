"""Data workers keep up with learners that eat small shards: a worker held back by
data.max_ready_shards asks again at the pace chunks complete (not a fixed second). Pure functions,
timestamps by hand."""

from __future__ import annotations

import pytest

from diloco.coordinator.service.chunks import MAX_RETRY_S, MIN_RETRY_S, retry_after_s


def test_small_shards_completing_fast_are_asked_for_again_soon() -> None:
    done = [10.0 + 0.03 * i for i in range(8)]  # digits: a 665-row shard made every 0.03 s
    assert retry_after_s(done, now=done[-1] + 0.01) == MIN_RETRY_S
    spaced = [10.0, 10.2, 10.4, 10.6]
    assert retry_after_s(spaced, now=10.65) == pytest.approx(0.1)
    assert retry_after_s(spaced, now=10.6) < 1.0  # the fixed wait that kept learners waiting 69%


def test_large_shards_or_nothing_completing_wait_a_second_as_before() -> None:
    assert retry_after_s([], now=5.0) == MAX_RETRY_S  # nothing measured yet
    assert retry_after_s([1.0], now=5.0) == MAX_RETRY_S
    assert retry_after_s([0.0, 20.0, 40.0], now=41.0) == MAX_RETRY_S  # text shards, 20 s apart
    assert retry_after_s([0.0, 0.1, 0.2], now=0.9) == pytest.approx(0.35)  # backs off meanwhile
    assert retry_after_s([0.0, 0.1, 0.2], now=60.0) == MAX_RETRY_S
