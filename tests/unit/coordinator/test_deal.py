"""Dealing train shards to learner slots: pure decisions, state built by hand."""

from __future__ import annotations

from diloco.coordinator.deal import Candidate, choose_shard, take_slot, vacant_slots


def shards(*positions: int) -> list[Candidate]:
    return [Candidate(shard_id=100 + p, position=p) for p in positions]


def test_a_slot_is_the_lowest_not_held_by_a_live_learner() -> None:
    assert take_slot(2, {}, set(), "a") == 0
    assert take_slot(2, {"a": 0}, {"a"}, "b") == 1
    assert take_slot(2, {"a": 0, "b": 1}, {"a", "b"}, "c") is None  # more learners than slots
    assert take_slot(2, {"a": 0, "b": 1}, {"b"}, "c") == 0  # a is dead: its slot is free


def test_a_learner_keeps_its_slot_and_a_restarted_one_gets_it_back() -> None:
    assert take_slot(4, {"a": 2}, {"a"}, "a") == 2
    assert take_slot(4, {"a": 2}, set(), "a") == 2  # not live yet after its restart: still its own


def test_only_a_slot_whose_learner_died_is_vacant() -> None:
    # Slot 1 was never taken (its learner may still be starting): not vacant.
    assert vacant_slots(3, {"a": 0, "c": 2}, {"a"}) == {2}
    assert vacant_slots(3, {}, set()) == set()


def test_own_positions_first_lowest_first() -> None:
    choice = choose_shard(shards(0, 1, 2, 3, 5), slot=1, slots=2, vacant=(), own_work_coming=True)
    assert choice.shard_id == 101, choice.reason
    choice = choose_shard(shards(0, 2, 3, 5), slot=1, slots=2, vacant=(), own_work_coming=True)
    assert choice.shard_id == 103, choice.reason


def test_waits_for_its_own_shard_rather_than_take_another_slots() -> None:
    choice = choose_shard(shards(0, 2, 4), slot=1, slots=2, vacant=(), own_work_coming=True)
    assert choice.shard_id is None
    assert "being made" in choice.reason


def test_takes_a_vacant_slots_shard_before_waiting() -> None:
    choice = choose_shard(shards(0, 2, 4), slot=1, slots=2, vacant={0}, own_work_coming=True)
    assert choice.shard_id == 100, choice.reason


def test_takes_anything_once_its_own_are_used_up() -> None:
    choice = choose_shard(shards(4, 2), slot=1, slots=2, vacant=(), own_work_coming=False)
    assert choice.shard_id == 102, choice.reason
    assert choose_shard([], slot=1, slots=2, vacant=(), own_work_coming=False).shard_id is None


def test_without_a_slot_or_dealing_the_lowest_position_wins() -> None:
    assert choose_shard(shards(3, 1, 2), slot=None, slots=2, vacant=(), own_work_coming=False).shard_id == 101
    assert choose_shard(shards(3, 1, 2), slot=0, slots=0, vacant=(), own_work_coming=True).shard_id == 101


def test_a_lower_own_position_being_made_is_waited_for_in_order() -> None:
    """Positions 1 and 5 are the slot's; 5 is ready while a data worker still makes 1. Taking 5
    would make a learner's rows depend on which shard was ready first (two runs of one seed once
    trained different chunks); it waits for 1. A lower one merely pending (its attempt failed)
    is not waited for."""
    made_first = shards(0, 5)
    choice = choose_shard(made_first, slot=1, slots=2, vacant=(), own_work_coming=True, own_being_made=1)
    assert choice.shard_id is None and "dealt in order" in choice.reason
    assert choose_shard(made_first, slot=1, slots=2, vacant=(), own_work_coming=True).shard_id == 105
    ready = choose_shard(shards(1, 5), slot=1, slots=2, vacant=(), own_work_coming=True, own_being_made=7)
    assert ready.shard_id == 101, ready.reason


def test_a_learner_with_open_shards_leaves_the_other_slots_to_their_learner() -> None:
    """Four train shards, two slots, a learner mixing up to four shards at once: slot 0's learner
    asked for a third and fourth while it held 0 and 2, took 1 and 3 (its own were used up), and
    slot 1's learner trained nothing all run. While it holds open shards it waits instead."""
    choice = choose_shard(shards(1, 3), slot=0, slots=2, vacant=(), own_work_coming=False, holding=2)
    assert choice.shard_id is None and "holds 2" in choice.reason
    # Its own still come first whatever it holds, and a dead learner's slot is still shared out.
    assert (
        choose_shard(shards(1, 2), slot=0, slots=2, vacant=(), own_work_coming=False, holding=1).shard_id
        == 102
    )
    orphan = choose_shard(shards(1, 3), slot=0, slots=2, vacant={1}, own_work_coming=False, holding=2)
    assert orphan.shard_id == 101, orphan.reason


def test_a_learner_with_nothing_open_still_takes_what_is_left() -> None:
    # Alone (the other slot's learner never came) or at the tail: no rows wait for anyone.
    choice = choose_shard(shards(3, 1), slot=0, slots=2, vacant=(), own_work_coming=False, holding=0)
    assert choice.shard_id == 101, choice.reason
    # Without dealing (or without a slot), what a learner holds changes nothing.
    assert (
        choose_shard(shards(3, 1), slot=None, slots=2, vacant=(), own_work_coming=False, holding=3).shard_id
        == 101
    )
