"""How long pulls take on the learner's side, reported with its heartbeats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from diloco.v1 import coordinator_pb2 as pb

T = TypeVar("T")


class PullClock:
    """The receiving side of pulls: time from a stream's first message to its end, summed, and the
    fragments they brought. The coordinator's own clock stops once the last piece is handed to
    gRPC, with most of it still in buffers on its side of the link."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()  # pulls run on the sync thread and, at (re)joins, the main one
        self.seconds = 0.0
        self.fragments = 0

    def timed(self, messages: Iterable[T]) -> Iterator[T]:
        first = None
        for message in messages:
            if first is None:
                first = self._now()
            yield message
        if first is not None:
            with self._lock:
                self.seconds += self._now() - first

    def count(self, fragments: int) -> None:
        with self._lock:
            self.fragments += fragments

    def report(self, heartbeat: pb.HeartbeatRequest) -> pb.HeartbeatRequest:
        heartbeat.pull_seconds, heartbeat.pulled_fragments = self.seconds, self.fragments
        return heartbeat
