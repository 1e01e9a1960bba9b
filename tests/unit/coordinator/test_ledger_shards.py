"""Shards in the ledger: leases, pushes of rows, merges counted exactly once, under a fake clock."""

from diloco.coordinator.ledger import ChunkLease, Ledger, ShardLease
from tests.support import commit_merge, shard_row
from tests.unit.coordinator.ledger_setup import (
    ROWS,
    TOKENS_PER_ROW,
    TTL,
    complete,
    make,
    push,
    with_train_shard,
)

# -- shards ---------------------------------------------------------------------------------------


def test_lease_shard_gives_all_rows_of_a_fresh_shard(ledger):
    (sid,) = with_train_shard(ledger)
    lease = ledger.lease_shard("L1", TTL)
    assert isinstance(lease, ShardLease)
    assert (lease.shard_id, lease.rows, lease.todo) == (sid, ROWS, [(0, ROWS)])
    assert lease.uri == f"file:///shards/{shard_row(ledger, sid)['chunk_id']}.zst"
    assert ledger.lease_shard("L2", TTL) == "wait"  # leased by L1, not finished


def test_lease_shard_waits_while_chunks_are_unprocessed(ledger):
    make(ledger, ["train"])
    assert ledger.lease_shard("L1", TTL) == "wait"


def test_dealt_shards_go_to_their_slot_whatever_order_they_were_made_in(ledger):
    make(ledger, ["train"] * 4)
    positions = ledger.train_positions()
    holders = {}
    for i in range(4):
        lease = ledger.lease_chunk(f"d{i}", TTL)
        assert isinstance(lease, ChunkLease)
        holders[lease.chunk_id] = f"d{i}"
    # Made in reverse, the first one not at all yet: first come, first served would hand slot 0
    # whatever was ready first.
    for cid in sorted(positions, key=positions.get, reverse=True)[:3]:
        assert complete(ledger, holders[cid], cid).accepted
    got = {}
    for slot in (0, 1, 0, 1):
        lease = ledger.lease_shard(f"L{slot}", TTL, slot=slot, slots=2)
        got.setdefault(slot, []).append(
            lease if isinstance(lease, str) else positions[shard_row(ledger, lease.shard_id)["chunk_id"]]
        )
    assert got[1] == [1, 3]
    # Slot 0's position 2 is ready, position 0's chunk is still being made: it waits for it, in
    # order (taking 2 first made a learner's rows depend on which was ready first), and it does
    # not take slot 1's. Once 0 is made, it gets 0, then 2.
    assert got[0] == ["wait-dealt", "wait-dealt"]
    first = min(positions, key=positions.get)
    assert complete(ledger, holders[first], first).accepted
    dealt = [ledger.lease_shard("L0", TTL, slot=0, slots=2) for _ in range(2)]
    assert [positions[shard_row(ledger, d.shard_id)["chunk_id"]] for d in dealt] == [0, 2]


def test_a_learner_holding_its_own_shards_leaves_the_other_slots_shards(ledger):
    """The small-dataset starvation: four train shards made, slot 0's learner (mixing four at
    once) asks four times before slot 1's learner asks once. It gets its two; slot 1's stay."""
    with_train_shard(ledger, ("train",) * 4)
    positions = ledger.train_positions()

    def position(lease):
        return lease if isinstance(lease, str) else positions[shard_row(ledger, lease.shard_id)["chunk_id"]]

    got = [position(ledger.lease_shard("L0", TTL, slot=0, slots=2)) for _ in range(4)]
    assert got == [0, 2, "wait", "wait"]
    assert [position(ledger.lease_shard("L1", TTL, slot=1, slots=2)) for _ in range(2)] == [1, 3]
    assert ledger.lease_shard("L1", TTL, slot=1, slots=2) == "wait"


def test_a_learner_holding_nothing_takes_another_slots_shard(ledger):
    # Slot 1's learner never asked (it may never come): slot 0's, once its own is trained and
    # merged and it holds nothing open, takes slot 1's shard, so no rows wait for it.
    with_train_shard(ledger, ("train",) * 2)
    positions = ledger.train_positions()
    own = ledger.lease_shard("L0", TTL, slot=0, slots=2)
    assert ledger.lease_shard("L0", TTL, slot=0, slots=2) == "wait"
    assert push(ledger, "p1", [(own.shard_id, 0, ROWS)], worker="L0", released=[own.shard_id]) is None
    commit_merge(ledger, 0, 1, ["p1"], ROWS * TOKENS_PER_ROW, 5, 2.5, "quorum")
    taken = ledger.lease_shard("L0", TTL, slot=0, slots=2)
    assert positions[shard_row(ledger, taken.shard_id)["chunk_id"]] == 1


def test_data_workers_make_only_so_many_shards_ahead_per_slot(ledger):
    make(ledger, ["train"] * 6 + ["eval"])
    positions = ledger.train_positions()
    taken = [ledger.lease_chunk(f"d{i}", TTL, max_ready=4, slots=2) for i in range(6)]
    made = [lease for lease in taken if isinstance(lease, ChunkLease)]
    # Two per slot are being made; the eval chunk is never held back; then nothing more.
    assert sorted(positions[c.chunk_id] % 2 for c in made if c.spec.split == "train") == [0, 0, 1, 1]
    assert [c.spec.split for c in made].count("eval") == 1
    assert taken[-1] == "wait"
    # Slot 0's learner starts one of its shards: slot 0 may have one more made, slot 1 not.
    first = next(c for c in made if c.spec.split == "train" and positions[c.chunk_id] % 2 == 0)
    assert complete(ledger, "d0", first.chunk_id).accepted
    lease = ledger.lease_shard("L0", TTL, slot=0, slots=2)
    assert isinstance(lease, ShardLease)
    more = ledger.lease_chunk("d9", TTL, max_ready=4, slots=2)
    assert isinstance(more, ChunkLease) and positions[more.chunk_id] % 2 == 0


def test_eval_shards_are_never_leased(ledger):
    with_train_shard(ledger, ("eval", "eval"))
    assert ledger.lease_shard("L1", TTL) == "done"
    assert len(ledger.summary()["eval_shards"]) == 2


def test_push_then_merge_consumes_shard_and_counts_tokens(ledger):
    (sid,) = with_train_shard(ledger, ("train", "eval"))[:1]
    ledger.lease_shard("L1", TTL)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    assert push(ledger, "p2", [(sid, 4, 10)], released=[sid]) is None
    assert ledger.push_state("p1")["state"] == "pending"
    commit_merge(ledger, 0, 1, ["p1"], 4 * TOKENS_PER_ROW, 5, 2.5, "quorum")
    assert ledger.push_state("p1")["state"] == "merged"
    assert shard_row(ledger, sid)["state"] != "consumed"
    assert ledger.counter("tokens_merged") == 4 * TOKENS_PER_ROW
    assert ledger.fragment_version(0) == 1
    commit_merge(ledger, 0, 2, ["p2"], 6 * TOKENS_PER_ROW, 5, 2.0, "quorum")
    assert shard_row(ledger, sid)["state"] == "consumed"
    assert ledger.counter("tokens_merged") == ROWS * TOKENS_PER_ROW
    assert ledger.fragment_version(0) == 2
    summary = ledger.summary()
    assert summary["shards_consumed"] == 1
    assert summary["rounds"] == 2
    assert ledger.lease_shard("L2", TTL) == "done"
    assert ledger.train_data_exhausted()  # the run finishes on its own (lifecycle)


def test_train_data_is_exhausted_only_when_every_train_shard_is_consumed(ledger):
    assert not ledger.train_data_exhausted()  # no data yet is not the end of it
    make(ledger, ["train", "eval"])
    assert not ledger.train_data_exhausted()  # a train chunk still pending
    (sid,) = with_train_shard(ledger)
    assert not ledger.train_data_exhausted()  # a ready shard
    ledger.lease_shard("L1", TTL)
    assert not ledger.train_data_exhausted()  # a leased one


def test_one_merge_of_several_pushes_over_two_shards(ledger):
    s1, s2 = with_train_shard(ledger, ("train", "train"))
    assert push(ledger, "p1", [(s1, 0, 10), (s2, 0, 3)]) is None
    assert push(ledger, "p2", [(s2, 3, 10)], worker="L2") is None
    commit_merge(ledger, 0, 1, ["p1", "p2"], 0, 0, None, "all")
    assert shard_row(ledger, s1)["state"] == shard_row(ledger, s2)["state"] == "consumed"
    assert ledger.counter("tokens_merged") == 2 * ROWS * TOKENS_PER_ROW
    # Each learner's share, for aging its claim on the token budget (lifecycle.Claim).
    assert ledger.tokens_merged_of("L1") == (ROWS + 3) * TOKENS_PER_ROW
    assert ledger.tokens_merged_of("L2") == (ROWS - 3) * TOKENS_PER_ROW
    assert ledger.tokens_merged_of("nobody") == 0


def test_pending_rows_are_not_leased_again(ledger):
    (sid,) = with_train_shard(ledger)
    ledger.lease_shard("L1", TTL)
    assert push(ledger, "p1", [(sid, 0, 4)], released=[sid]) is None
    lease = ledger.lease_shard("L2", TTL)
    assert lease.todo == [(4, ROWS)]


def test_dropped_push_rows_become_leasable_after_release(ledger):
    (sid,) = with_train_shard(ledger)
    ledger.lease_shard("L1", TTL)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    assert push(ledger, "p2", [(sid, 4, 7)]) is None
    commit_merge(ledger, 0, 1, ["p1"], 0, 0, None, "quorum")
    ledger.drop_pushes(["p2"], "too stale")
    assert ledger.push_state("p2")["state"] == "dropped"
    assert ledger.push_state("p2")["reason"] == "too stale"
    ledger.release_shards("L1", [sid])
    lease = ledger.lease_shard("L2", TTL)
    assert lease.todo == [(4, ROWS)]
    assert ledger.counter("tokens_merged") == 4 * TOKENS_PER_ROW


def test_drop_does_not_undo_a_merge(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    commit_merge(ledger, 0, 1, ["p1"], 0, 0, None, "quorum")
    ledger.drop_pushes(["p1"], "late drop")
    assert ledger.push_state("p1")["state"] == "merged"
    assert ledger.lease_shard("L1", TTL).todo == [(4, ROWS)]


def test_learner_leaving_returns_its_shard_with_dropped_rows(ledger):
    (sid,) = with_train_shard(ledger)
    ledger.join("L1", "compute", "h1")
    ledger.lease_shard("L1", TTL)
    assert push(ledger, "p1", [(sid, 2, 6)]) is None
    ledger.drop_pushes(["p1"], "learner died")
    ledger.leave("L1")
    assert ledger.lease_shard("L2", TTL).todo == [(0, ROWS)]


def test_expired_shard_lease_returns_to_pool(ledger, clock):
    (sid,) = with_train_shard(ledger)
    ledger.lease_shard("L1", TTL)
    clock.advance(11)
    assert ledger.lease_shard("L2", TTL).shard_id == sid
    assert ledger.renew("L1", [], [sid], TTL) == ([], [sid])


def test_rows_already_trained_by_another_push_are_counted_once(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 5)]) is None
    # A learner that lost its lease comes back with rows 3..7: its delta is accepted, but only
    # rows 5..7 are credited to it; rows 3..5 stay p1's.
    assert push(ledger, "p2", [(sid, 3, 7)], worker="L2") is None
    assert ledger.push_state("p2")["state"] == "pending"
    commit_merge(ledger, 0, 1, ["p1", "p2"], 0, 0, None, "quorum")
    assert ledger.counter("tokens_merged") == 7 * TOKENS_PER_ROW
    assert ledger.counter("rows_trained_twice") == 2
    # Rows inside a merged span are not counted again either.
    assert push(ledger, "p3", [(sid, 4, 6)], worker="L3") is None
    commit_merge(ledger, 0, 2, ["p3"], 0, 0, None, "quorum")
    assert ledger.counter("tokens_merged") == 7 * TOKENS_PER_ROW
    assert ledger.lease_shard("L1", TTL).todo == [(7, ROWS)]


def test_record_push_refuses_spans_overlapping_each_other(ledger):
    (sid,) = with_train_shard(ledger)
    # Malformed (one learner trains each row once per push): refused, and nothing recorded.
    reason = push(ledger, "p1", [(sid, 0, 5), (sid, 3, 7)])
    assert reason == "spans of this push overlap each other"
    assert ledger.push_state("p1") is None
    assert ledger.counter("pushes_received") == ledger.counter("tokens_trained") == 0


def test_record_push_refuses_spans_outside_the_shard(ledger):
    (sid,) = with_train_shard(ledger)
    for spans in ([(sid, 8, 11)], [(sid, 5, 5)], [(sid + 100, 0, 1)]):
        reason = push(ledger, "px", spans)
        assert isinstance(reason, str) and "not inside" in reason
    assert ledger.push_state("px") is None


def test_merged_tokens_counted_once_per_row(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 3)]) is None
    commit_merge(ledger, 0, 1, ["p1"], 0, 0, None, "quorum")
    assert push(ledger, "p1b", [(sid, 0, 3)], worker="L2") is None  # accepted, but none of its rows are new
    commit_merge(ledger, 0, 2, ["p1b"], 0, 0, None, "quorum")
    assert ledger.counter("tokens_merged") == 3 * TOKENS_PER_ROW


def test_dropped_state_push_is_recorded_without_spans(ledger):
    (sid,) = with_train_shard(ledger)
    ledger.lease_shard("L1", TTL)
    assert (
        ledger.record_push("old", "L1", 0, 0, 5, 40, [(sid, 0, 5)], [sid], state="dropped", reason="stale")
        is None
    )
    assert ledger.push_state("old")["state"] == "dropped"
    assert ledger.counter("pushes_refused") == 1
    assert ledger.lease_shard("L2", TTL).todo == [(0, ROWS)]


def test_next_epoch_drops_pending_pushes(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    assert push(ledger, "p2", [(sid, 4, 6)]) is None
    commit_merge(ledger, 0, 1, ["p1"], 0, 0, None, "quorum")
    assert ledger.next_epoch() == 1
    assert ledger.push_state("p1")["state"] == "merged"
    assert ledger.push_state("p2")["state"] == "dropped"
    assert ledger.lease_shard("L1", TTL).todo == [(4, ROWS)]
    assert ledger.next_epoch() == 2


def test_state_survives_reopen(tmp_path, clock):
    path = str(tmp_path / "l.sqlite")
    led = Ledger(path, clock=clock)
    (sid,) = with_train_shard(led)
    assert push(led, "p1", [(sid, 0, 4)]) is None
    commit_merge(led, 0, 3, ["p1"], 0, 0, 1.5, "quorum")
    led.close()
    again = Ledger(path, clock=clock)
    try:
        assert again.fragment_version(0) == 3
        assert again.counter("tokens_merged") == 4 * TOKENS_PER_ROW
        assert again.lease_shard("L1", TTL).todo == [(4, ROWS)]
    finally:
        again.close()


def test_a_corrupt_shards_data_is_open_until_it_is_made_again_and_merged(ledger):
    """A corrupt shard's chunk is made again (into the same shard row): the data is open until
    then, and done once the remade shard's rows are merged."""
    (sid,) = with_train_shard(ledger)
    assert ledger.report_corrupt_shard(sid, "checksum mismatch")
    assert not ledger.train_data_exhausted()  # its chunk is pending again
    lease = ledger.lease_chunk("d2", TTL)
    assert isinstance(lease, ChunkLease)
    (new,) = [complete(ledger, "d2", lease.chunk_id, completion_id="again").shard_id]
    assert new == sid and not ledger.train_data_exhausted()  # the remade shard is ready
    assert isinstance(ledger.lease_shard("L1", TTL), ShardLease)
    assert push(ledger, "p1", [(new, 0, ROWS)], released=[new]) is None
    commit_merge(ledger, 0, 1, ["p1"], ROWS * TOKENS_PER_ROW, 5, 1.0, "quorum")
    assert ledger.lease_shard("L2", TTL) == "done" and ledger.train_data_exhausted()
