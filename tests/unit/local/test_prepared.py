"""--prepare-first: when the data is ready for the learners, read from the coordinator's status."""

from __future__ import annotations

import math

from diloco.local.prepared import shards_prepared, wait_until_prepared


def test_the_data_is_ready_once_every_chunk_is_a_shard_or_quarantined():
    assert shards_prepared({"chunks_total": 4, "chunks_done": 3}) == (False, "3/4 chunks made into shards")
    assert shards_prepared({"chunks_total": 4, "chunks_done": 3, "chunks_quarantined": 1})[0]
    assert shards_prepared({"chunks_total": 4, "chunks_done": 4}) == (True, "4/4 chunks made into shards")
    assert not shards_prepared({})[0]  # the coordinator has not split the dataset yet


def test_it_waits_through_missing_readings_until_the_data_is_ready():
    readings = iter([None, {"chunks_total": 2, "chunks_done": 1}, {"chunks_total": 2, "chunks_done": 2}])
    said: list[str] = []
    got = wait_until_prepared(lambda: next(readings), lambda: True, math.inf, said.append, poll_s=0)
    assert got == "2/2 chunks made into shards"
    assert not any("warning" in line for line in said)


def test_without_a_data_worker_or_time_left_the_learners_start_on_what_there_is():
    half = {"chunks_total": 2, "chunks_done": 1}
    said: list[str] = []
    assert (
        wait_until_prepared(lambda: half, lambda: False, math.inf, said.append, poll_s=0)
        == "1/2 chunks made into shards"
    )
    assert "no data worker is left at 1/2" in said[-1]
    wait_until_prepared(lambda: half, lambda: True, 0.0, said.append, poll_s=0)  # a deadline long past
    assert "the time budget ran out" in said[-1]
