"""The push journal (push_journal): entries round-trip, a gap or a torn entry ends the journal
there, a saved state drops what it holds, and a replay brings a state's rows and fragments to
where the dead life's pushes took them."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.compute import push_journal
from diloco.compute.local_state import state_path
from diloco.compute.push_journal import JournaledPush
from diloco.compute.rows import AwaitingCover, RowBook, Unpushed
from diloco.v1 import coordinator_pb2 as pb
from tests.unit.compute.test_local_state import a_state


def journaled(count: int, fragment: int, spans: tuple[tuple[int, int, int], ...] = ()) -> JournaledPush:
    header = pb.TensorHeader(fragment=fragment, version=3, push_id=f"push-{count}", inner_steps=4, tokens=40)
    header.spans.extend(pb.ShardSpan(shard_id=s, row_start=a, row_end=b) for s, a, b in spans)
    return JournaledPush(count, header, {"w": torch.arange(6, dtype=torch.float32) * count})


def test_entries_round_trip_in_order_and_end_at_a_gap_or_a_torn_one(tmp_path: Path) -> None:
    path = state_path(tmp_path, "learner-0")
    for count in (3, 4, 5, 7):
        push_journal.write(path, journaled(count, count % 2, [(1, count, count + 1)]))
    back = push_journal.after(path, 2)
    assert [(j.count, j.header.push_id, j.header.fragment) for j in back] == [
        (3, "push-3", 1), (4, "push-4", 0), (5, "push-5", 1),
    ]  # fmt: skip
    assert back[1].header.spans[0].row_start == 4 and torch.equal(
        back[1].tensors["w"], journaled(4, 0).tensors["w"]
    )
    assert push_journal.after(path, 5) == []  # 6 is missing: nothing after it can be replayed
    assert push_journal.after(path, 0) == []  # nor after a state whose next push has no entry
    push_journal.entry_path(path, 4).write_bytes(b"torn")
    assert [j.count for j in push_journal.after(path, 2)] == [3]
    push_journal.drop(path, upto=4)  # a state holding push 4 was saved
    assert [n for n, _ in push_journal.entries(path)] == [5, 7]
    half = push_journal.entry_path(path, 8)
    half.with_name(half.name + ".tmp").write_bytes(b"half written at a kill")
    push_journal.drop(path)
    assert push_journal.entries(path) == [] and not list(tmp_path.glob("*.tmp"))


def test_a_replay_carries_the_rows_as_the_dead_life_did() -> None:
    """The state: fragment 0 in flight, rows (5, 0, 8) pushed with it and waiting for fragment 1,
    rows (7, 16, 24) trained since. The dead life then pushed fragment 1 (carrying both: the first
    group completes, the second now waits for fragment 0), took fragment 0's merge and pushed it
    again. Replayed, every row is carried and both fragments are in flight with their last push."""
    state, _ = a_state(tmp_steps=7)
    assert state.rows.awaiting[0].waiting == {1} and state.rows.unpushed.spans == [(7, 16, 24)]
    first, second = journaled(1, 1), journaled(2, 0)
    pushed = push_journal.replay(state, [first], keeps_overlap=True)
    assert pushed == {1} and state.push_count == 1
    assert state.fragments[1].in_flight and state.fragments[1].push[1] is first.tensors  # type: ignore[index]
    assert state.pushes[1][0].push_id == "push-1"
    assert [(g.rows.spans, g.waiting) for g in state.rows.awaiting] == [([(7, 16, 24)], {0})]
    assert state.rows.unpushed.spans == [] and state.rows.resolved.spans == []
    assert state.row_spans() == [(7, 16, 24)]  # (5, 0, 8) rode on push 1: not the state's to push

    # Without keep_overlap, fragment 0's merge overwrote it before push 2 left: its waiting rows
    # rode on push 2. The state's own push of fragment 0 is no longer the one in flight.
    pushed = push_journal.replay(state, [second], keeps_overlap=False)
    assert pushed == {0} and state.push_count == 2 and state.pushes[0][0].push_id == "push-2"
    assert state.row_spans() == [] and state.rows.all_carried()


def test_a_replay_with_keep_overlap_leaves_the_rows_waiting_for_the_next_push() -> None:
    """With keep_overlap the merge kept the steps since the push: rows waiting for fragment 0
    wait for its next push, which the replayed push 2 is (it carries them)."""
    state, _ = a_state(tmp_steps=7)
    state.rows = RowBook(Unpushed([(9, 0, 4)]), [AwaitingCover(Unpushed([(5, 0, 8)]), {0})], Unpushed())
    push_journal.replay(state, [journaled(1, 0)], keeps_overlap=True)
    # (5, 0, 8) was waiting for fragment 0: carried now; (9, 0, 4) waits for fragment 1.
    assert [(g.rows.spans, g.waiting) for g in state.rows.awaiting] == [([(9, 0, 4)], {1})]


def test_a_replay_gives_the_resuming_life_none_of_the_dead_lifes_time() -> None:
    """Goodput's kept work is time in inner steps, per life: the dead life reported its own in its
    heartbeats. Replayed, push 1 leaves rows (7, 16, 24) waiting for fragment 0 as made at the new
    life's time 0, not at the 25 s the dead life had trained: the new life's own push of fragment
    0, 1 s into its steps, completes them and keeps none of the dead life's 25 s as its own."""
    state, _ = a_state(tmp_steps=7)
    state.busy_s = 25.0  # the dead life's time in inner steps when the state was copied
    push_journal.replay(state, [journaled(1, 1)], keeps_overlap=True)
    assert [(g.rows.spans, g.waiting, g.busy_s) for g in state.rows.awaiting] == [([(7, 16, 24)], {0}, 0.0)]
    assert state.rows.kept_busy_s == 0.0
    carried = state.rows.carry(0, len(state.fragments), 1.0)  # the resumed life's first push
    assert carried.spans == [(7, 16, 24)] and state.rows.all_carried()
    assert state.rows.kept_busy_s == 0.0
