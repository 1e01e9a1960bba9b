"""A learner's state on local disk: the file round-trips, the writer never blocks, the resume
decision is a pure function of the state and the run, and a real learner killed with -9 resumes."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import torch

from diloco.compute import local_state, push_journal
from diloco.compute.held import HeldFragment
from diloco.compute.local_state import LocalState, resume_decision, state_path
from diloco.compute.rows import AwaitingCover, RowBook, Unpushed
from diloco.compute.state_writer import StateWriter
from diloco.config import RunConfig
from diloco.model import build_model, make_inner_optimizer
from diloco.v1 import coordinator_pb2 as pb
from tests.support import wait_for


def a_state(tmp_steps: int = 7) -> tuple[LocalState, torch.optim.Optimizer]:
    cfg = RunConfig().with_overrides(
        {"model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32, "model.kwargs.n_head": 2}
    )
    model = build_model(cfg.model, 256, 1)
    optimizer = make_inner_optimizer(model, cfg.train)
    loss = model({"input_ids": torch.randint(0, 256, (2, cfg.model.seq_len + 1))})
    loss.backward()
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    frags = [
        HeldFragment(names[:2], version=3, steps=5, tokens=500, loss_sum=9.5),
        HeldFragment(names[2:], version=2),
    ]
    frags[0].base = {n: params[n] + 1 for n in names[:2]}
    frags[0].in_flight, frags[0].apply_at = True, 9
    header = pb.TensorHeader(fragment=0, version=3, push_id="abc", inner_steps=5, tokens=500)
    header.spans.append(pb.ShardSpan(shard_id=4, row_start=0, row_end=8))
    frags[0].push = (header, {names[0]: torch.ones(3)})
    unpushed = Unpushed([(7, 16, 24)], released=[7])
    state = LocalState(
        run_id="run-1",
        worker_id="learner-0",
        inner_steps=tmp_steps,
        busy_s=1.5,
        first_loss=5.5,
        schedule_shift=2,
        params=params,
        optimizer=local_state.copy_optimizer(optimizer),
        fragments=frags,
        pushes={0: frags[0].push},
        residual={names[0]: torch.full((2,), 0.25)},
        rows=RowBook(unpushed, [AwaitingCover(Unpushed([(5, 0, 8)]), {1})], Unpushed()),
        held_shards=[5, 7],
        row_tokens={4: 129, 5: 129, 7: 130},
    )
    return state, optimizer


def test_the_file_round_trips_everything_but_released_shards(tmp_path: Path) -> None:
    state, optimizer = a_state()
    path = state_path(tmp_path, "learner-0")
    local_state.save(path, state)
    back = local_state.load(path, [f.names for f in state.fragments])
    assert back is not None
    assert back.run_id == "run-1" and back.inner_steps == 7 and back.schedule_shift == 2
    assert all(torch.equal(back.params[n], t) for n, t in state.params.items())
    assert back.fragments[0].version == 3 and back.fragments[0].in_flight and back.fragments[0].apply_at == 9
    assert torch.equal(
        back.fragments[0].base[state.fragments[0].names[0]],
        state.fragments[0].base[state.fragments[0].names[0]],
    )
    header, blobs = back.pushes[0]
    assert (
        header.push_id == "abc"
        and header.spans[0].row_end == 8
        and torch.equal(next(iter(blobs.values())), torch.ones(3))
    )
    assert back.row_spans() == [(7, 16, 24), (5, 0, 8)]
    assert back.rows.unpushed.released == []  # the old leases are given back at resume, not by a push
    assert back.held_shards == [5, 7]
    assert back.row_tokens == {4: 129, 5: 129, 7: 130}  # a resumed learner's claim counts its rows at once
    # The optimizer state loads into a fresh optimizer of the same model.
    optimizer.load_state_dict(back.optimizer)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_torn_or_foreign_file_means_a_fresh_start(tmp_path: Path) -> None:
    path = state_path(tmp_path, "learner-0")
    path.write_bytes(b"not a safetensors file")
    assert local_state.load(path, [[]]) is None
    assert local_state.load(tmp_path / "absent.safetensors", [[]]) is None


def test_resume_decision_names_its_reason() -> None:
    state, _ = a_state()
    shapes = {n: tuple(t.shape) for n, t in state.params.items()}
    kw = {"run_id": "run-1", "worker_id": "learner-0", "shapes": shapes, "max_staleness": 4}
    ok = resume_decision(state, current_versions=[5, 2], **kw)
    assert ok.resume and "step 7" in ok.reason
    assert resume_decision(None, current_versions=[5, 2], **kw).reason == "no local state"
    other_run = resume_decision(state, current_versions=[5, 2], **{**kw, "run_id": "run-2"})
    assert not other_run.resume and "another run" in other_run.reason
    stale = resume_decision(state, current_versions=[8, 2], **kw)
    assert not stale.resume and "fragment 0" in stale.reason and "stale" in stale.reason
    ahead = resume_decision(state, current_versions=[2, 2], **kw)  # the run lost merges we hold
    assert not ahead.resume and "newer than" in ahead.reason
    assert not resume_decision(state, current_versions=[3], **kw).resume
    assert not resume_decision(state, current_versions=[3, 2], **{**kw, "shapes": {"x": (1,)}}).resume


def a_push(fragment: int, push_id: str) -> tuple[pb.TensorHeader, dict[str, torch.Tensor]]:
    header = pb.TensorHeader(fragment=fragment, version=2, push_id=push_id, inner_steps=5, tokens=500)
    return header, {"w": torch.full((4,), float(fragment + 1))}


def test_a_state_older_than_the_last_push_resumes_only_with_that_push_journaled(tmp_path: Path) -> None:
    """Killed after a push and before the next copy: the state still holds the pushed steps as
    unpushed. Resumed as it is, the learner would push that work again and the syncer merge it
    twice; the push count, noted on disk before each push leaves, says so, even when the push
    came at the very step of the copy (the end game hands in after the step's copy: a chaos run's
    learner resumed such a state and a 1-step push of fragment 0 merged twice). The push journal,
    written by the writer thread, holds each such push: with it, the state resumes (the push is
    replayed on it, push_journal), and a push no longer brings the next copy forward."""
    state, _ = a_state(tmp_steps=7)
    shapes = {n: tuple(t.shape) for n, t in state.params.items()}
    kw = {"run_id": "run-1", "worker_id": "learner-0", "shapes": shapes, "max_staleness": 4}
    path = state_path(tmp_path, "learner-0")
    # max_share 1: a copy's cost (here its save, some milliseconds) holds back no later copy
    # longer than it took; test_state_cadence has the budget itself.
    writer = StateWriter(path, every_s=3600.0, max_share=1.0)
    try:
        # The first copy is due at once, however long the machine has been up (monotonic time
        # starts near its boot: a young machine once waited every_s for it).
        assert writer.due(time.monotonic())
        writer.note_push(*a_push(1, "first"))
        state.push_count = writer.push_count  # copied at step 7, after the push at step 6
        writer.offer(state)
        wait_for(lambda: writer.writes >= 1, 20, "the first copy")
        assert not writer.due(time.monotonic())  # offered just now: the next is every_s away
        assert local_state.pushed_count(path) == 1
        assert push_journal.entries(path) == []  # the copy holds the push: its entry is gone
        back = local_state.load(path, [f.names for f in state.fragments])
        assert back is not None and back.push_count == 1
        assert resume_decision(back, current_versions=[5, 2], pushes_noted=1, **kw).resume
        writer.note_push(*a_push(1, "second"))  # pushed at the step the state was copied, after the copy
        assert not writer.due(time.monotonic())  # no copy brought forward by a push
        wait_for(lambda: writer.journaled >= 2, 20, "the push's journal entry")
        noted = local_state.pushed_count(path)
        same_step = resume_decision(back, current_versions=[5, 2], pushes_noted=noted, **kw)
        assert not same_step.resume and "merged twice" in same_step.reason
        journal = push_journal.after(path, back.push_count)
        assert [(j.count, j.header.push_id) for j in journal] == [(2, "second")]
        journaled = tuple(j.header.fragment for j in journal)
        replayed = resume_decision(
            back, current_versions=[5, 2], pushes_noted=noted, journaled=journaled, **kw
        )
        assert replayed.resume and "replaying 1 push(es) from the journal" in replayed.reason
        # The journaled fragment starts over from the run's version: its staleness refuses nothing.
        assert resume_decision(
            back, current_versions=[5, 9], pushes_noted=noted, journaled=journaled, **kw
        ).resume
        assert not resume_decision(back, current_versions=[5, 9], pushes_noted=noted, **kw).resume
        # A restarted writer goes on counting from the marker; a fresh life counts anew and
        # leaves no copy or journal of the last life to be taken for its own.
        again = StateWriter(path, every_s=3600.0)
        assert again.push_count == 2
        again.start_fresh()
        assert again.push_count == 0 and not path.exists() and local_state.pushed_count(path) is None
        assert push_journal.entries(path) == []
        again.close()
    finally:
        writer.discard()
    assert local_state.pushed_count(path) is None  # a clean end leaves nothing


def test_the_writer_keeps_only_the_newest_state_and_discard_removes_it(tmp_path: Path) -> None:
    path = state_path(tmp_path, "learner-0")
    writer = StateWriter(path, every_s=0.0)
    for steps in (1, 2, 3):
        state, _ = a_state(steps)
        writer.offer(state)
    wait_for(lambda: path.exists() and writer.due(time.monotonic()), 20, "the writer to finish")
    back = local_state.load(path, [f.names for f in state.fragments])
    assert back is not None and back.inner_steps == 3
    assert 1 <= writer.writes <= 3
    writer.discard()
    assert not path.exists()


def test_the_writer_times_each_copy_and_holds_the_next_back_by_its_cost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy that took the training thread 2 s, at 1% of the time: none for 200 s, whatever the
    pushes (the learner of a large model trains instead of copying; the journal holds its pushes)."""
    state, _ = a_state(tmp_steps=3)
    writer = StateWriter(state_path(tmp_path, "learner-0"), every_s=0.0, max_share=0.01)
    try:
        assert writer.due(time.monotonic())
        writer.offer(state, copy_s=2.0)
        wait_for(lambda: writer.writes >= 1, 20, "the copy")
        writer.note_push(*a_push(0, "after"))
        with caplog.at_level(logging.INFO, logger="diloco.local_state"):
            assert not writer.due(time.monotonic())
            assert not writer.due(time.monotonic())
        held = [r.getMessage() for r in caplog.records if "held back" in r.getMessage()]
        assert len(held) == 1  # said once, not at every step
        # The cost is the training thread's 2 s and the save (with its fsync) after it.
        cost = float(re.search(r"cost (\d+\.\d+)s", held[0]).group(1))  # type: ignore[union-attr]
        assert 2.0 <= cost < 3.0
        # (2 s + the save's milliseconds) / 1%: still held back 150 s on...
        assert not writer.due(time.monotonic() + 150.0)
        # ...and due ~200 s on, with room for a slow disk's save
        assert writer.due(time.monotonic() + 300.0)
        # What the learner's last line says the copies cost this life, against its training.
        assert writer.copies_s == 2.0 and writer.saves_cpu_s > 0.0
        said = writer.describe(busy_s=100.0)
        wait_for(lambda: writer.journaled == 1, 20, "the push's journal entry")
        said = writer.describe(busy_s=100.0)
        assert said.startswith(
            "local state: 1 copies saved and 1 pushes journaled, copying 2.00s + saving "
        ), said
        assert f"({(2.0 + writer.saves_cpu_s) / 100:.1%} of the 100.0s in inner steps)" in said
    finally:
        writer.discard()
