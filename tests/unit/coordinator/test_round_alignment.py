"""A learner whose push misses the others' round is told by how much, on a real coordinator.

Quorum-1 rounds merge each push alone once learners drift apart by more than the grace window,
and such rounds cost eval loss (benchmarks/quality.py). The push reply says how late the push
came for the previous round; the learner's schedule then moves that much earlier
(schedule.catch_up_steps), so the two meet in one round again without anyone waiting.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.v1 import coordinator_pb2 as pb
from tests.support import delta_header, tiny_coordinator

STEP_TIME_S = 0.05  # so one sync period is H·0.05 = 2.5 s and half of it 1.25 s


def push(
    learner: CoordinatorClient, init: dict[str, torch.Tensor], push_id: str, version: int
) -> pb.PushReply:
    header = delta_header(learner, "fp32", push_id)
    header.version = version
    header.step_time_s = STEP_TIME_S
    return learner.push(header, {n: torch.randn_like(t) * 1e-3 for n, t in init.items()})


def wait_version(running, version: int) -> None:
    deadline = time.monotonic() + 20
    while running.service.fragments[0].version < version:
        assert time.monotonic() < deadline, f"no merge to version {version}"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_a_push_after_the_round_closed_is_told_how_late_it_was(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"train.inner_steps": 50}) as (running, first, init):
        second = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        second.join()
        try:
            alone = push(first, init, "a-1", version=0)
            assert alone.accepted and alone.missed_round_by_s == 0.0  # no round before it
            wait_version(running, 1)  # quorum 1, no grace window: it merged alone
            time.sleep(0.3)
            late = push(second, init, "b-1", version=0)
            assert late.accepted
            assert 0.3 <= late.missed_round_by_s < 1.25, late
            wait_version(running, 2)
            # Half a period or more after the last round's first push is early for the next
            # round, not late for the last one: nothing to make up.
            time.sleep(1.3)
            early = push(first, init, "a-2", version=1)
            assert early.accepted and early.missed_round_by_s == 0.0, early
        finally:
            second.close()


@pytest.mark.timeout(120)
def test_a_resumed_learner_giving_back_leases_does_not_close_the_round(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """A learner resumed from local state gives its dead life's leases back before its delta is
    ready. That message (release_only) says nothing about the round: the round keeps its grace
    window for the learner's delta. An empty push without it ("nothing from me") closes it."""
    overrides = {"train.inner_steps": 50, "sync.grace_factor": 3.0, "sync.overlap_steps": 10}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        second = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        second.join()
        try:
            held = second.lease_shard().shard_id
            assert push(first, init, "a-1", version=0).accepted  # window: 3 · (10 · 0.05 s) = 1.5 s
            give_back = pb.TensorHeader(fragment=0, version=0, codec="fp32", release_only=True)
            give_back.released_shards.append(held)
            assert second.push(give_back, {}).reason == "shards released"
            time.sleep(0.5)
            assert running.service.fragments[0].version == 0  # still waiting for second's delta
            state = running.service.ledger._one("SELECT state FROM shards WHERE id = ?", (held,))
            assert state == "ready"  # the lease went back all the same
            nothing = pb.TensorHeader(fragment=0, version=0, codec="fp32")
            assert second.push(nothing, {}).reason == "nothing to merge"
            wait_version(running, 1)  # every live learner has had its say
        finally:
            second.close()


@pytest.mark.timeout(120)
def test_a_push_that_joins_the_round_late_is_told_by_how_much(tiny_corpus: Path, tmp_path: Path) -> None:
    """Both learners meet in the round, one 0.6 s after the other: more than half the overlap
    (10 steps of 0.05 s), so the late one hears half its lag and will push that much earlier."""
    overrides = {"train.inner_steps": 50, "sync.grace_factor": 3.0, "sync.overlap_steps": 10}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        second = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        second.join()
        try:
            opened = push(first, init, "a-1", version=0)
            assert opened.accepted and opened.missed_round_by_s == 0.0
            time.sleep(0.6)
            late = push(second, init, "b-1", version=0)
            assert late.accepted and 0.3 <= late.missed_round_by_s < 0.75, late  # half its lag
            wait_version(running, 1)
            assert running.service.fragments[0].previous_round[1] == {first.worker_id, second.worker_id}
        finally:
            second.close()


@pytest.mark.timeout(120)
def test_a_push_asked_about_while_its_round_merges_is_answered_below_that_merge(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """A learner asks again about a pending push (after a coordinator restart) just as its round
    merges and is published. The answer must be a version below that merge, or the learner waits
    for a later one that may never come: a chaos test's run ended 2 minutes late that way. The
    publish is made to land between the ledger read and the rest of the answer (the window the
    answer once had); read under the syncer's lock, it waits until the answer is made."""
    with tiny_coordinator(tiny_corpus, tmp_path, {"train.inner_steps": 50, "sync.quorum": 2}) as (
        running,
        first,
        init,
    ):
        second = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        second.join()
        service = running.service
        try:
            assert push(first, init, "a-1", version=0).accepted  # pending: the quorum is 2
            read = service.ledger.push_state
            closer = threading.Thread(target=lambda: push(second, init, "b-1", version=0))

            def read_then_let_the_round_merge(push_id: str):
                row = read(push_id)
                if push_id == "a-1" and not closer.is_alive() and row["state"] == "pending":
                    closer.start()  # the second push closes the round: merged and published
                    deadline = time.monotonic() + 3
                    while service.fragments[0].published_version < 1 and time.monotonic() < deadline:
                        time.sleep(0.02)
                return row

            service.ledger.push_state = read_then_let_the_round_merge
            again = push(first, init, "a-1", version=0)
            service.ledger.push_state = read
            closer.join(20)
            wait_version(running, 1)
            assert again.accepted and again.version == 0, again  # the merge that holds it is 1
        finally:
            second.close()
