"""A client stream that stalls gives its slot back.

Pushes take one of coordinator.max_inflight_pushes slots for as long as they stream, and the first
learner's init the one initialization slot. A client that sends a header and then nothing (or a
piece now and then) would hold its slot for good, and 16 of them would stop every honest push; a
stalled init left the run without a model. Each such stream is watched: it must send its header
within `header_s` (when set), go on sending (a message at least every `idle_s`) and finish within a
deadline that grows with the bytes its header declares (at `min_bytes_per_s`, far below any real
link). The decision is a pure function of the clock (`stalled`); the watcher only asks it and
cancels the call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StreamLimits:
    idle_s: float = 30.0  # longest silence between two messages
    base_s: float = 60.0  # every push's allowance, whatever its size
    min_bytes_per_s: float = 1 << 20  # then 1 MiB/s of what its header declares
    header_s: float = 0.0  # longest wait for the first message, its header (0: idle_s)


def stalled(
    now: float,
    started: float,
    last_message_at: float,
    declared_bytes: int,
    limits: StreamLimits,
    header_seen: bool = True,
) -> str:
    """Why a stream must end now ("" while it may go on)."""
    if not header_seen and limits.header_s and now - started > limits.header_s:
        return f"no header in {now - started:.0f} s (at most {limits.header_s:g} s)"
    if now - last_message_at > limits.idle_s:
        return f"no message for {now - last_message_at:.0f} s (at most {limits.idle_s:g} s between two)"
    allowed = limits.base_s + declared_bytes / limits.min_bytes_per_s
    if now - started > allowed:
        return f"{now - started:.0f} s streaming {declared_bytes} bytes (at most {allowed:.0f} s)"
    return ""


class StreamWatch:
    """Watches one stream: `messages(it)` passes it through, noting each message; a thread asks
    `stalled` every `poll_s` and calls `cancel` with the reason once it says so."""

    def __init__(
        self,
        limits: StreamLimits,
        cancel: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.5,
    ) -> None:
        self.limits, self.cancel, self.clock, self.poll_s = limits, cancel, clock, poll_s
        self.started = self.last = clock()
        self.declared_bytes = 0
        self.header_seen = False
        self.reason = ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stream-watch", daemon=True)

    def __enter__(self) -> StreamWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def messages(self, stream: Iterator[T]) -> Iterator[T]:
        for message in stream:
            self.last = self.clock()
            self.header_seen = True
            yield message

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            reason = stalled(
                self.clock(), self.started, self.last, self.declared_bytes, self.limits, self.header_seen
            )
            if reason:
                self.reason = reason
                self.cancel(reason)
                return
