"""A resumed learner going on in step with the others: its push schedule past the pushes its
journal replayed and forward by the steps that died with its last life (schedule.resume_lag_steps,
past_replayed_pushes, advance_now; KeepsLocalState._catch_up_after_resume), and its pushes sent
again before its shards are given back (_resume_in_flight)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from diloco.compute.learner import Learner
from diloco.compute.resume import ResumeLag
from diloco.compute.schedule import advance_now, fragment_due, past_replayed_pushes, resume_lag_steps
from diloco.v1 import coordinator_pb2 as pb
from tests.unit.compute.test_keep_overlap import Submitted, learner_with_one_tensor, train


def test_the_lag_is_the_others_steps_since_the_copy_less_this_lifes():
    assert resume_lag_steps(2.0, 3, 0.1, 50) == 17  # they stepped 20, we 3 since resuming
    assert resume_lag_steps(2.0, 3 + 15, 0.1, 50) == 2  # and the journal's push moved us 15 on
    assert resume_lag_steps(2.0, 3, 0.1, 25) == 12  # half an interval at most
    assert resume_lag_steps(0.2, 3, 0.1, 25) == 0  # caught up already: never backwards
    assert resume_lag_steps(2.0, 3, 0.0, 25) == 0  # no step time yet
    assert resume_lag_steps(-1.0, 3, 0.1, 25) == 0  # a copy "from the future" (clock moved)


def test_the_schedule_goes_on_past_the_pushes_the_journal_replayed():
    # H = 50, two fragments: push points every 25 steps, fragment 0 at 25, 75, ..., 1 at 50, 100, ...
    assert past_replayed_pushes(110, [], 50, 2) == 0
    assert past_replayed_pushes(110, [0], 50, 2) == 15  # fragment 0 was pushed at 125
    assert past_replayed_pushes(110, [1], 50, 2) == 40  # 125 skipped (in flight), 1 pushed at 150
    assert past_replayed_pushes(110, [0, 1], 50, 2) == 40
    assert past_replayed_pushes(125, [0], 50, 2) == 0  # copied at the push's own step, before it
    assert past_replayed_pushes(125, [0, 1], 50, 2) == 25
    # Then the next push point is the other fragment's, as the dead life's next push would have been.
    assert fragment_due(110 + 15 + 25, 50, 2) == 1


@given(
    behind=st.integers(0, 40),
    position=st.integers(0, 500),
    interval=st.integers(2, 60),
)
def test_a_move_never_skips_a_push_due(behind: int, position: int, interval: int):
    take = advance_now(behind, position, interval)
    assert 0 <= take <= behind
    # No push point is passed over: the next one may become due now, none lies in between.
    assert not any(k % interval == 0 for k in range(position + 1, position + take))
    if position % interval == 0:
        assert take == 0  # a push due at this very step comes first


class Channel(Submitted):
    def take_missed(self, after: int) -> float:
        return 0.0


def pushes_of(learner: Learner, steps: int) -> dict[int, int]:
    """{step: fragment} the learner pushes over `steps` steps of 0.1 s (merges taken at once)."""
    learner.channel = Channel()  # type: ignore[assignment]
    pushed = {}
    for _ in range(steps):
        train(learner, 0.01, shard=1)
        learner.progress.life_steps += 1
        learner.progress.busy_s += 0.1
        before = learner.channel.submitted
        learner._push_due()
        if learner.channel.submitted > before:
            p = learner.channel.jobs[-1][0].fragment
            pushed[learner.progress.inner_steps] = p
            learner.frags[p].in_flight = False  # its merge back at once
    return pushed


def test_a_resumed_learner_pushes_as_many_steps_earlier_as_it_lost_and_skips_no_push():
    learner = learner_with_one_tensor(keep=True)
    learner.cfg = learner.cfg.with_overrides({"train.inner_steps": 50})  # a push every 25 steps
    learner.progress.inner_steps = 180  # where its local state was copied
    # Its state copied 8.6 s ago by a life stepping every second: the others are 9 steps on (8.6
    # to 9.4 s by the first check), less the one this life took before its first push check.
    learner.resume_lag = ResumeLag(copied_at=time.time() - 8.6, step_time_s=1.0, made=0)
    pushed = pushes_of(learner, 80)
    as_before = {s: fragment_due(s, 50, 2) for s in range(181, 261) if fragment_due(s, 50, 2) is not None}
    assert list(pushed.values()) == list(as_before.values())  # the same fragments in turn
    assert list(pushed) == [s - 8 for s in as_before]  # each 8 steps earlier
    assert learner.schedule_shift == 8 and learner.resume_lag is None


def test_a_state_without_a_step_time_waits_for_this_lifes_own():
    learner = learner_with_one_tensor(keep=True)
    learner.cfg = learner.cfg.with_overrides({"train.inner_steps": 50})
    learner.progress.inner_steps = 180
    learner.resume_lag = ResumeLag(copied_at=time.time() - 100.0, step_time_s=0.0, made=0)
    pushed = pushes_of(learner, 80)
    assert list(pushed)[:2] == [200 - 12, 225 - 12]  # far behind: half an interval at most
    assert learner.schedule_shift == 12


def test_a_learner_resumed_at_once_keeps_its_schedule():
    learner = learner_with_one_tensor(keep=True)
    learner.cfg = learner.cfg.with_overrides({"train.inner_steps": 50})
    learner.resume_lag = ResumeLag(copied_at=time.time() + 100.0, step_time_s=0.1, made=0)  # nothing lost
    pushed = pushes_of(learner, 60)
    assert list(pushed) == [25, 50]
    assert learner.schedule_shift == 0


class Prefetcher:
    def __init__(self) -> None:
        self.skipped: list = []

    def skip(self, spans) -> None:
        self.skipped.extend(spans)

    def lease_after(self, ready) -> None:
        self.ready = ready


def test_a_resumed_life_resends_its_pushes_before_it_gives_its_shards_back():
    """A shard given back is leased again at once; its rows still to train leave out only the
    rows of pushes the ledger has recorded. So the replayed pushes go first."""
    learner = learner_with_one_tensor(keep=True)
    learner.channel = Channel()  # type: ignore[assignment]
    learner.prefetcher = Prefetcher()  # type: ignore[assignment]
    header = pb.TensorHeader(fragment=0, version=0, codec="fp32", inner_steps=5, push_id="journaled")
    header.spans.add(shard_id=1, row_start=277, row_end=384)
    learner.frags[0].in_flight, learner.frags[0].push = True, (header, {})
    state = SimpleNamespace(row_spans=lambda: [(3, 0, 10)], held_shards=[1])
    learner._resume_in_flight(state)  # type: ignore[arg-type]
    sent = [h for h, _ in learner.channel.jobs]
    assert [h.push_id for h in sent[:-1]] == ["journaled"]
    assert sent[-1].release_only and list(sent[-1].released_shards) == [1]
    assert learner.prefetcher.skipped == [(3, 0, 10)]
