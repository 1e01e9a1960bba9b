"""A stalled push stream gives its slot back (diloco.coordinator.stream_watch): the rule by moving
timestamps, the watcher with a fake clock."""

from __future__ import annotations

import threading

from diloco.coordinator.stream_watch import StreamLimits, StreamWatch, stalled

LIMITS = StreamLimits(idle_s=30.0, base_s=60.0, min_bytes_per_s=1e6)


def test_a_stream_that_goes_on_sending_may_take_its_time() -> None:
    assert stalled(100.0, 0.0, 99.0, declared_bytes=50_000_000, limits=LIMITS) == ""  # 110 s allowed


def test_silence_between_two_messages_ends_it() -> None:
    reason = stalled(131.0, 100.0, 100.0, declared_bytes=0, limits=LIMITS)
    assert "no message for 31 s" in reason


def test_a_trickle_ends_at_the_deadline_its_size_allows() -> None:
    # A message every few seconds never trips the idle rule; 10 MB may take 60 + 10 s.
    assert stalled(69.0, 0.0, 68.0, declared_bytes=10_000_000, limits=LIMITS) == ""
    assert "at most 70 s" in stalled(71.0, 0.0, 70.0, declared_bytes=10_000_000, limits=LIMITS)


def test_the_watcher_cancels_a_stalled_stream_once() -> None:
    now = [0.0]
    cancelled: list[str] = []
    done = threading.Event()

    def cancel(reason: str) -> None:
        cancelled.append(reason)
        done.set()

    with StreamWatch(LIMITS, cancel, clock=lambda: now[0], poll_s=0.01) as watch:
        stream = watch.messages(iter(["header", "piece"]))
        next(stream)
        now[0] = 20.0
        next(stream)  # noted at t = 20
        now[0] = 45.0
        assert not done.wait(0.1)  # 25 s of silence: still within 30
        now[0] = 51.0
        assert done.wait(5.0)
    assert len(cancelled) == 1 and "no message for 31 s" in cancelled[0]
