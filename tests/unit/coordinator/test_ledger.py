"""Lease ranges and deadlines, chunks and workers in the ledger, under a fake clock."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator import leases
from diloco.coordinator.ledger import ChunkLease, Ledger, ShardLease
from tests.support import commit_merge
from tests.unit.coordinator.ledger_setup import (
    ROWS,
    TOKENS_PER_ROW,
    TTL,
    complete,
    make,
    push,
    spec,
    with_train_shard,
)

# -- pure range functions -------------------------------------------------------------------------


def test_normalise_sorts_merges_and_drops_empty():
    assert leases.normalise([(5, 7), (0, 2), (2, 3), (4, 4), (6, 9), (8, 6)]) == [(0, 3), (5, 9)]
    assert leases.normalise([]) == []


def test_subtract_hand_cases():
    assert leases.subtract((0, 10), []) == [(0, 10)]
    assert leases.subtract((0, 10), [(2, 4), (6, 8)]) == [(0, 2), (4, 6), (8, 10)]
    assert leases.subtract((0, 10), [(0, 10)]) == []
    assert leases.subtract((0, 10), [(-5, 3), (9, 20)]) == [(3, 9)]
    assert leases.subtract((5, 8), [(0, 2), (10, 12)]) == [(5, 8)]
    assert leases.subtract((0, 10), [(4, 6), (3, 5)]) == [(0, 3), (6, 10)]
    assert leases.subtract((3, 3), [(0, 1)]) == []


def test_covered_rows_counts_overlaps_once():
    assert leases.covered_rows([(0, 5), (3, 8), (10, 12)]) == 10
    assert leases.covered_rows([]) == 0


def test_overlaps():
    assert not leases.overlaps([(0, 2), (2, 4)])  # touching is fine: ranges are half-open
    assert leases.overlaps([(0, 3), (2, 4)])
    assert leases.overlaps([(5, 9), (0, 6)])
    assert not leases.overlaps([(1, 1), (0, 5)])  # an empty range shares no row
    assert leases.overlaps([(0, 5), (1, 2)])


def test_deadlines_and_liveness():
    assert leases.lease_deadline(100.0, 10.0) == 110.0
    assert leases.is_live(100.0, 109.9, 10.0)
    assert not leases.is_live(100.0, 110.0, 10.0)


ranges = st.tuples(st.integers(-5, 60), st.integers(-5, 60))


@settings(derandomize=True, deadline=None)
@given(
    total=st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted).map(tuple),
    taken=st.lists(ranges, max_size=8),
)
def test_subtract_property(total, taken):
    result = leases.subtract(total, taken)
    start, end = total
    taken_rows = {r for a, b in taken for r in range(a, b)}
    result_rows = [r for a, b in result for r in range(a, b)]
    # Non-empty, sorted, non-overlapping ranges.
    assert all(a < b for a, b in result)
    assert result == sorted(result)
    assert not leases.overlaps(result)
    # Disjoint from taken, inside total, and with the taken part covers total exactly.
    assert not set(result_rows) & taken_rows
    assert all(start <= r < end for r in result_rows)
    assert len(result_rows) == len(set(result_rows))
    assert set(result_rows) | (taken_rows & set(range(start, end))) == set(range(start, end))


@settings(derandomize=True, deadline=None)
@given(st.lists(ranges, max_size=8))
def test_normalise_property(rs):
    out = leases.normalise(rs)
    assert {r for a, b in out for r in range(a, b)} == {r for a, b in rs for r in range(a, b)}
    assert all(out[i][1] < out[i + 1][0] for i in range(len(out) - 1))  # merged, gaps between
    assert leases.covered_rows(rs) == sum(b - a for a, b in out)


# -- chunks ---------------------------------------------------------------------------------------


def test_initialize_is_idempotent(ledger):
    make(ledger, ["train", "train"])
    make(ledger, ["train", "train", "train", "train"])
    assert ledger.initialized
    assert [c for c, _, _ in ledger.chunk_shard_pairs()] == [1, 2]


def test_leased_chunk_carries_its_spec(ledger):
    make(ledger, ["train", "eval"])
    first = ledger.lease_chunk("d1", TTL)
    second = ledger.lease_chunk("d1", TTL)
    assert isinstance(first, ChunkLease) and isinstance(second, ChunkLease)
    assert {first.spec, second.spec} == {spec(0, "train"), spec(1, "eval")}
    assert first.attempt == 1


def test_expired_chunk_lease_goes_to_another_worker(ledger, clock):
    make(ledger, ["train"])
    ledger.join("d1", "data", "h1")
    ledger.join("d2", "data", "h2")
    first = ledger.lease_chunk("d1", TTL)
    assert isinstance(first, ChunkLease)
    assert ledger.lease_chunk("d2", TTL) == "wait"
    clock.advance(11)
    again = ledger.lease_chunk("d2", TTL)
    assert isinstance(again, ChunkLease)
    assert again.chunk_id == first.chunk_id
    assert again.attempt == 2
    # The first holder learns it lost the chunk when it renews.
    lost_chunks, lost_shards = ledger.renew("d1", [first.chunk_id], [], TTL)
    assert lost_chunks == [first.chunk_id]
    assert lost_shards == []


def test_renew_before_expiry_keeps_the_lease(ledger, clock):
    make(ledger, ["train"])
    lease = ledger.lease_chunk("d1", TTL)
    clock.advance(8)
    assert ledger.renew("d1", [lease.chunk_id], [], TTL) == ([], [])
    clock.advance(7)  # 15 s after the lease, 7 s after the renewal
    assert ledger.lease_chunk("d2", TTL) == "wait"
    assert ledger.renew("d1", [lease.chunk_id], [], TTL) == ([], [])


def test_renew_of_a_chunk_never_held_reports_it_lost(ledger):
    make(ledger, ["train"])
    lease = ledger.lease_chunk("d1", TTL)
    assert ledger.renew("d2", [lease.chunk_id, 99], [], TTL) == ([lease.chunk_id, 99], [])


def test_lease_chunk_wait_then_done(ledger):
    make(ledger, ["train", "train"])
    a = ledger.lease_chunk("d1", TTL)
    b = ledger.lease_chunk("d2", TTL)
    assert {a.chunk_id, b.chunk_id} == {1, 2}
    assert ledger.lease_chunk("d3", TTL) == "wait"
    assert complete(ledger, "d1", a.chunk_id).accepted
    assert ledger.lease_chunk("d3", TTL) == "wait"
    assert complete(ledger, "d2", b.chunk_id).accepted
    assert ledger.lease_chunk("d3", TTL) == "done"


def test_first_completion_wins_and_retries_are_idempotent(ledger, clock):
    make(ledger, ["train"])
    slow = ledger.lease_chunk("d1", TTL)
    clock.advance(11)
    fast = ledger.lease_chunk("d2", TTL)
    assert fast.chunk_id == slow.chunk_id
    won = complete(ledger, "d2", fast.chunk_id, "done-by-d2")
    assert won.accepted and won.shard_id > 0
    # A retry of the same completion (reply lost) gets the same answer and adds nothing.
    retry = complete(ledger, "d2", fast.chunk_id, "done-by-d2")
    assert retry.accepted and retry.shard_id == won.shard_id
    # The slow worker's own completion comes too late.
    late = complete(ledger, "d1", slow.chunk_id, "done-by-d1")
    assert not late.accepted
    assert "already" in late.reason
    assert ledger.chunk_shard_pairs() == [(slow.chunk_id, 1, "done")]
    assert ledger.summary()["shards_total"] == 1


def test_completion_id_reused_for_another_chunk_is_refused(ledger):
    make(ledger, ["train", "train"])
    a = ledger.lease_chunk("d1", TTL)
    b = ledger.lease_chunk("d1", TTL)
    assert complete(ledger, "d1", a.chunk_id, "same").accepted
    assert not complete(ledger, "d1", b.chunk_id, "same").accepted
    assert ledger.chunk_shard_pairs() == [(a.chunk_id, 1, "done"), (b.chunk_id, 0, "leased")]


def test_completion_of_unknown_chunk_refused(ledger):
    make(ledger, ["train"])
    result = complete(ledger, "d1", 42)
    assert not result.accepted and "unknown" in result.reason


def test_fail_chunk_quarantines_after_max_attempts(ledger):
    make(ledger, ["train"])
    lease = ledger.lease_chunk("d1", TTL)
    assert ledger.fail_chunk("d1", lease.chunk_id, "bad bytes", max_attempts=2) is False
    lease = ledger.lease_chunk("d1", TTL)  # the chunk is back in the pool
    assert lease.attempt == 2
    assert ledger.fail_chunk("d1", lease.chunk_id, "bad bytes again", max_attempts=2) is True
    assert ledger.lease_chunk("d1", TTL) == "done"
    summary = ledger.summary()
    assert summary["chunks_quarantined"] == 1
    assert summary["quarantined"] == [{"chunk": lease.chunk_id, "error": "bad bytes again"}]
    refused = complete(ledger, "d1", lease.chunk_id)
    assert not refused.accepted and "quarantined" in refused.reason


def test_expired_leases_count_as_attempts(ledger, clock):
    make(ledger, ["train"])
    ledger.lease_chunk("d1", TTL)
    clock.advance(11)
    lease = ledger.lease_chunk("d2", TTL)
    assert lease.attempt == 2
    assert ledger.fail_chunk("d2", lease.chunk_id, "boom", max_attempts=2) is True


# -- workers --------------------------------------------------------------------------------------


def test_live_workers_respects_ttl(ledger, clock):
    ledger.join("w1", "data", "h")
    clock.advance(5)
    ledger.join("w2", "data", "h")
    ledger.join("L1", "compute", "h")
    assert sorted(ledger.live_workers("data", TTL)) == ["w1", "w2"]
    assert ledger.live_workers("compute", TTL) == ["L1"]
    clock.advance(6)  # w1 silent for 11 s, w2 for 6 s
    assert ledger.live_workers("data", TTL) == ["w2"]
    ledger.heartbeat("w1", {"steps": 3})
    assert sorted(ledger.live_workers("data", TTL)) == ["w1", "w2"]


def test_leave_frees_leases_at_once(ledger):
    make(ledger, ["train"])
    ledger.join("d1", "data", "h")
    lease = ledger.lease_chunk("d1", TTL)
    assert ledger.lease_chunk("d2", TTL) == "wait"
    ledger.leave("d1")
    assert not ledger.known_worker("d1")
    assert ledger.live_workers("data", TTL) == []
    again = ledger.lease_chunk("d2", TTL)
    assert isinstance(again, ChunkLease) and again.chunk_id == lease.chunk_id


def test_silent_worker_marked_lost(ledger, clock):
    ledger.join("d1", "data", "h")
    clock.advance(TTL + 1)
    assert ledger.reclaim_expired(TTL).lost == [("d1", "data")]  # named, for the log and the events
    assert not ledger.known_worker("d1")
    ledger.join("d1", "data", "h")  # a rejoin makes it active again
    assert ledger.known_worker("d1")


def chunk_leases(led: Ledger) -> list[int]:
    """Lease every pending chunk; their ids in the order handed out."""
    out = []
    while isinstance(lease := led.lease_chunk("d1", TTL), ChunkLease):
        out.append(lease.chunk_id)
    return out


def test_a_shuffle_seed_hands_chunks_and_shards_out_in_its_order(tmp_path, clock) -> None:
    def lease_all(path: str, seed: int | None) -> tuple[list[int], list[int]]:
        led = Ledger(path, clock=clock)
        led.initialize([spec(i, "train") for i in range(12)], shuffle_seed=seed, dataset="test")
        chunks = chunk_leases(led)
        # Completed in reverse, so shard ids run the other way: leases follow the chunks' order.
        shard_of = {c: complete(led, "d1", c).shard_id for c in reversed(chunks)}
        shards = []
        while isinstance(lease := led.lease_shard("L1", TTL), ShardLease):
            shards.append(lease.shard_id)
        led.close()
        return chunks, [shard_of[c] for c in chunks] == shards

    plain, _ = lease_all(str(tmp_path / "plain.sqlite"), None)
    assert plain == list(range(1, 13))  # no seed: the dataset's order
    first, follows = lease_all(str(tmp_path / "a.sqlite"), 5)
    again, _ = lease_all(str(tmp_path / "b.sqlite"), 5)
    other, _ = lease_all(str(tmp_path / "c.sqlite"), 6)
    assert sorted(first) == plain and first != plain
    assert first == again and first != other
    assert follows  # shards are leased in their chunks' order


def test_the_shuffled_order_survives_a_restart(tmp_path, clock) -> None:
    path = str(tmp_path / "ledger.sqlite")
    led = Ledger(path, clock=clock)
    led.initialize([spec(i, "train") for i in range(8)], shuffle_seed=3, dataset="test")
    first = led.lease_chunk("d1", TTL)
    led.close()
    led = Ledger(path, clock=clock)  # the coordinator restarted: initialize is a no-op now
    led.initialize([spec(i, "train") for i in range(8)], shuffle_seed=99, dataset="test")
    rest = chunk_leases(led)
    led.close()
    fresh = Ledger(str(tmp_path / "fresh.sqlite"), clock=clock)
    fresh.initialize([spec(i, "train") for i in range(8)], shuffle_seed=3, dataset="test")
    expected = chunk_leases(fresh)
    fresh.close()
    assert [first.chunk_id, *rest] == expected


def test_a_restarted_worker_keeps_its_earlier_lives_tokens(ledger) -> None:
    ledger.join("L1", "compute", "h")
    ledger.heartbeat("L1", {"tokens_trained": 500})
    ledger.heartbeat("L1", {"tokens_trained": 900, "busy_seconds": 30.0, "kept_busy_seconds": 24.0})
    ledger.join("L1", "compute", "h")  # killed and restarted under the same id: counts from 0
    ledger.heartbeat("L1", {"tokens_trained": 100})
    ledger.heartbeat("L1", {"tokens_trained": 300})
    assert ledger.counter("tokens_trained_by_earlier_lives") == 900
    # Its time in inner steps too, and how much of it a kill did not lose (for goodput).
    assert ledger.counter("busy_seconds_by_earlier_lives") == 30.0
    assert ledger.counter("kept_busy_seconds_by_earlier_lives") == 24.0


@pytest.mark.parametrize(("resumed", "banked"), [(27.5, 27.5), (20.0, 24.0), (0.0, 24.0)])
def test_a_resumed_life_tells_what_its_dead_life_kept_after_its_last_heartbeat(
    ledger, resumed: float, banked: float
) -> None:
    """The dead life's last heartbeat said 24 s kept; its last local-state copy, taken after that
    heartbeat, held 27.5 s (merged through the resume all the same). The new life says so at its
    first heartbeat; an older copy (20 s) or none (0: not resumed) leaves the heartbeat's 24 s."""
    ledger.join("L1", "compute", "h")
    ledger.heartbeat("L1", {"tokens_trained": 900, "busy_seconds": 30.0, "kept_busy_seconds": 24.0})
    ledger.join("L1", "compute", "h")
    ledger.heartbeat(
        "L1", {"tokens_trained": 10, "kept_busy_seconds": 0.0, "resumed_kept_busy_seconds": resumed}
    )
    ledger.heartbeat(
        "L1", {"tokens_trained": 300, "kept_busy_seconds": 5.0, "resumed_kept_busy_seconds": resumed}
    )
    assert ledger.counter("kept_busy_seconds_by_earlier_lives") == banked


def test_the_round_that_made_a_version_is_known_after_a_restart(ledger, clock) -> None:
    """A restarted coordinator tells the next round's first pusher how late it was for the last
    one: who pushed into the round that made the current version, and when it opened."""
    (sid,) = with_train_shard(ledger, ("train", "eval"))[:1]
    ledger.lease_shard("L1", TTL)
    start = clock.t
    assert push(ledger, "p1", [(sid, 0, 4)], worker="L1") is None
    clock.advance(2.0)
    assert push(ledger, "p2", [(sid, 4, 6)], worker="L2") is None
    assert ledger.round_pushers(0, 1) is None  # not merged yet
    commit_merge(ledger, 0, 1, ["p1", "p2"], 6 * TOKENS_PER_ROW, 10, 2.5, "every live learner pushed")
    assert ledger.round_pushers(0, 1) == (start, frozenset({"L1", "L2"}))
    assert ledger.round_pushers(1, 1) is None


def test_a_push_of_rows_the_same_worker_already_pushed_is_refused_as_re_sent_work(ledger):
    """A learner resumed from a state older than its last push sends that push's steps again:
    its own rows come back. Merging it would apply those steps twice, so it is refused and
    recorded (a retry gets the same answer); another worker's rows only count once (above)."""
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 5)]) is None
    reason = push(ledger, "p2", [(sid, 4, 9)])
    assert reason == "re-sent work: rows 1:[4,5) are in this worker's pending push p1 already".replace(
        "1:", f"{sid}:"
    )
    assert ledger.push_state("p2")["state"] == "dropped"
    assert ledger.push_state("p2")["reason"] == reason
    commit_merge(ledger, 0, 1, ["p1"], 5 * TOKENS_PER_ROW, 5, 2.5, "quorum")
    assert "merged push p1" in push(ledger, "p3", [(sid, 2, 3)])
    assert ledger.counter("tokens_trained") == 5 * TOKENS_PER_ROW  # the refused pushes count nothing
    assert ledger.lease_shard("L1", TTL).todo == [(5, ROWS)]  # their other rows are still to train
    assert push(ledger, "p4", [(sid, 5, 9)]) is None  # new rows of the same worker are new work


def test_a_push_dropped_by_a_restart_is_taken_afresh_and_counted_once(tmp_path, clock) -> None:
    """The coordinator restarts with a push in an open round: the push is dropped, its rows free.
    Sent again, it is recorded anew; rows someone else pushed meanwhile are cut out of it."""
    path = str(tmp_path / "ledger.sqlite")
    first = Ledger(path, clock=clock)
    (sid,) = with_train_shard(first, ("train", "eval"))[:1]
    first.lease_shard("L1", TTL)
    assert push(first, "p1", [(sid, 0, 6)]) is None
    trained = first.counter("tokens_trained")
    first.close()
    ledger = Ledger(path, clock=clock)
    assert ledger.pending_pushers() == {0: frozenset({"L1"})}  # whom the first round will wait for
    ledger.next_epoch()
    assert ledger.push_state("p1")["state"] == "dropped"
    assert ledger.pending_pushers() == {}
    assert push(ledger, "p2", [(sid, 0, 2)], worker="L2") is None  # rows 0-2 trained again meanwhile
    assert push(ledger, "p1", [(sid, 0, 6)]) is None  # sent again after the restart
    assert ledger.push_state("p1")["state"] == "pending"
    commit_merge(ledger, 0, 1, ["p1", "p2"], 6 * TOKENS_PER_ROW, 10, 2.5, "every live learner pushed")
    assert ledger.counter("tokens_merged") == 6 * TOKENS_PER_ROW  # rows 0-2 once, by p2
    assert ledger.counter("tokens_trained") == trained  # p1's first recording undone
    assert ledger.counter("rows_trained_twice") == 2
    assert ledger.counter("pushes_revived") == 1
    ledger.close()


def test_a_chunk_never_leased_cannot_be_completed(ledger):
    make(ledger, ["train", "train"])
    refused = complete(ledger, "d1", 2)  # nobody was given chunk 2
    assert not refused.accepted and "never leased" in refused.reason
    lease = ledger.lease_chunk("d1", TTL)
    assert isinstance(lease, ChunkLease) and complete(ledger, "d1", lease.chunk_id).accepted
