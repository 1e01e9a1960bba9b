"""The learner's clock on its pulls (diloco.pull_clock.PullClock): from a stream's first message to its
end, the long poll's wait before the first message left out. Moved timestamps, no sleeping."""

from __future__ import annotations

from collections.abc import Iterator

from diloco.pull_clock import PullClock
from diloco.v1 import coordinator_pb2 as pb


class FakeTime:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def arriving(clock: FakeTime, at: list[float]) -> Iterator[int]:
    """Messages that arrive at the given times; the stream ends when the last is consumed."""
    for i, t in enumerate(at):
        clock.now = t
        yield i


def test_a_pull_counts_from_its_first_message_to_its_end_not_the_wait_before() -> None:
    time = FakeTime(0.0)
    pulls = PullClock(now=time)
    # The request went out at 0; the merge came at 9 s (the long poll), its pieces over 1.5 s.
    assert list(pulls.timed(arriving(time, [9.0, 9.5, 10.5]))) == [0, 1, 2]
    pulls.count(1)
    assert pulls.seconds == 1.5 and pulls.fragments == 1


def test_an_empty_pull_adds_no_time_and_the_heartbeat_carries_the_sums() -> None:
    time = FakeTime(0.0)
    pulls = PullClock(now=time)
    assert list(pulls.timed(arriving(time, []))) == []
    list(pulls.timed(arriving(time, [3.0, 3.25])))
    list(pulls.timed(arriving(time, [7.0, 7.5])))
    pulls.count(2)
    beat = pulls.report(pb.HeartbeatRequest(worker_id="learner-0"))
    assert (beat.pull_seconds, beat.pulled_fragments) == (0.75, 2)
