"""A learner whose allowance of the token budget runs out: it asks once more before it hands in."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from diloco.compute.heartbeats import ALLOWANCE_ASK_S, Heartbeats
from diloco.compute.progress import Progress
from diloco.compute.rows import RowBook
from diloco.compute.schedule import budget_spent
from diloco.v1 import coordinator_pb2 as pb


class Coordinator:
    """Answers heartbeats with the allowances it is given, in turn."""

    def __init__(self, allowances: list[int]):
        self.allowances = allowances
        self.asked = 0
        self.pull_clock = SimpleNamespace(report=lambda request: None)

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.asked += 1
        return pb.HeartbeatReply(
            run_state=pb.RUN_STATE_RUNNING, coordinator_epoch=1, tokens_allowed=self.allowances.pop(0)
        )


class Learner(Heartbeats):
    def __init__(self, allowances: list[int]):
        self.client = Coordinator(allowances)
        self.frags, self.rows, self.row_tokens = [], RowBook(), {}
        self.progress = Progress()
        self.prefetcher = SimpleNamespace(held_shards=lambda: [])
        self.stop, self.finishing = threading.Event(), threading.Event()
        self.epoch = 1
        self.allowance = None
        self.hand_ins = 0

    def _on_starved(self, last_empty_push: float) -> float:
        self.hand_ins += 1
        return last_empty_push

    def step(self, tokens: int) -> None:
        self.progress.stepped(0.01, tokens, 1.0)


def test_a_learner_that_runs_out_asks_first_and_trains_on_without_a_hand_in():
    learner = Learner([100, 50])
    learner._heartbeat()  # the heartbeat thread: 100 tokens
    learner.step(100)
    assert budget_spent(learner.progress.tokens_trained, learner.allowance)
    learner._wait_for_allowance(0.0)
    # The last slice came with the ask: no hand-in's round trip before it.
    assert (learner.client.asked, learner.hand_ins) == (2, 0)
    assert not budget_spent(learner.progress.tokens_trained, learner.allowance)


def test_told_nothing_at_once_it_hands_in_and_asks_again_only_after_a_pause():
    learner = Learner([100, 0, 0])
    learner._heartbeat()
    learner.step(100)
    learner._wait_for_allowance(0.0)  # asked at once: nothing; so it hands in
    assert (learner.client.asked, learner.hand_ins) == (2, 1)
    learner._wait_for_allowance(0.0)  # no step since: no second ask at once (ALLOWANCE_ASK_S)
    assert (learner.client.asked, learner.hand_ins) == (2, 2)
    assert learner.progress.waiting_s > 0
    learner._allowance_asked_at -= ALLOWANCE_ASK_S  # the pause has passed (moved, not slept)
    learner._wait_for_allowance(0.0)
    assert (learner.client.asked, learner.hand_ins) == (3, 3)


def test_each_slice_trained_out_is_asked_about_once_at_once():
    learner = Learner([100, 50, 0, 0])
    learner._heartbeat()
    learner.step(100)
    learner._wait_for_allowance(0.0)  # asked at once: 50 more
    learner.step(50)
    learner._heartbeat()  # the heartbeat thread answers meanwhile: nothing left
    learner._wait_for_allowance(0.0)  # trained since its last ask: asks at once again, then hands in
    assert (learner.client.asked, learner.hand_ins) == (4, 1)
