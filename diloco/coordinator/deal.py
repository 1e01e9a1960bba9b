"""Which train shard a learner gets: dealt by slot, so a fault-free run is the same every time.

First come, first served hands shard k to whichever learner asks first, so two runs of one seed
train different learners on different rows and end several percent apart: more than the effects a
benchmark is after. With `data.deal = M`, train shards are dealt round-robin over M learner slots
by their place in the seeded lease order: slot s trains positions s, s + M, s + 2M, ... A learner
takes a slot the first time it asks for a shard (the lowest free one; a restarted learner under the
same id gets its own back), so the partition does not depend on who joined first.

Faults change the deal, and only faults do: the shards of a slot whose learner died go to the
others while it is vacant, and a learner whose own positions are used up takes anything left, so
no rows wait for a learner that may never come back: but only once it holds no open shard. A
learner mixes batches from several shards (data.mix_shards), so its prefetcher asks for more while
it still has work; taking another slot's then left a learner with no shard at all on a small
dataset (its partner leased all four). Pure functions: the service passes the state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A train shard with rows to train, at `position` in the train chunks' lease order."""

    shard_id: int
    position: int


@dataclass(frozen=True)
class DealChoice:
    shard_id: int | None  # None: nothing for this learner now ("wait" or "done" is the ledger's call)
    reason: str


def take_slot(slots: int, held: Mapping[str, int], live: Collection[str], worker_id: str) -> int | None:
    """The slot `worker_id` deals from: the one it holds, else the lowest not held by a live
    learner. None when every slot is taken (the learner is first come, first served)."""
    if worker_id in held:
        return held[worker_id]
    taken = {slot for worker, slot in held.items() if worker in live}
    return next((s for s in range(slots) if s not in taken), None)


def vacant_slots(slots: int, held: Mapping[str, int], live: Collection[str]) -> set[int]:
    """Slots whose learner is no longer live. A slot nobody took yet is not vacant: its learner
    may still be starting, and taking its shards would make the deal depend on start-up timing."""
    alive = {slot for worker, slot in held.items() if worker in live}
    ever = set(held.values())
    return {s for s in range(slots) if s in ever and s not in alive}


def choose_shard(
    candidates: list[Candidate],
    slot: int | None,
    slots: int,
    vacant: Collection[int],
    own_work_coming: bool,
    own_being_made: int | None = None,
    holding: int = 0,
) -> DealChoice:
    """The shard for a learner in `slot` of `slots`, from the leasable candidates.

    Own positions first, in order: a lower own position a data worker is making now
    (`own_being_made`, the lowest) is waited for rather than skipped, or which rows a learner
    holds would depend on which shard happened to be ready first (two runs of one seed once
    trained different chunks: 3.015 against 2.945). While more of its own are still being made,
    it waits for them rather than take another slot's; then a vacant slot's; then, once its own
    are used up, anything left, but only while it holds none open (`holding`: train shards it has
    leased): a learner with work in hand leaves a live slot's shards to that slot's learner.
    Without a slot (or with dealing off, slots = 0) the lowest position wins.
    """
    ordered = sorted(candidates, key=lambda c: c.position)
    if slot is None or slots <= 0:
        return DealChoice(ordered[0].shard_id if ordered else None, "first come")
    own = [c for c in ordered if c.position % slots == slot]
    if own and own_being_made is not None and own_being_made < own[0].position:
        return DealChoice(None, f"slot {slot}'s position {own_being_made} is being made: dealt in order")
    if own:
        return DealChoice(own[0].shard_id, f"slot {slot}'s position {own[0].position}")
    orphans = [c for c in ordered if c.position % slots in vacant]
    if orphans:
        return DealChoice(orphans[0].shard_id, f"vacant slot {orphans[0].position % slots}'s shard")
    if own_work_coming:
        return DealChoice(None, f"slot {slot}'s next shard is still being made")
    if ordered and holding:
        return DealChoice(None, f"slot {slot}'s shards are used up; it holds {holding}: others' stay theirs")
    if ordered:
        return DealChoice(ordered[0].shard_id, f"slot {slot}'s shards are used up: taking any")
    return DealChoice(None, "no shard ready")
