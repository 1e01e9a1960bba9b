"""Bytes on the wire, per RPC kind and direction, counted where every message passes: here.

Counts are serialized protobuf sizes (what gRPC frames carry, less its 5-byte frame prefix and
HTTP/2 headers, which a later issue may add).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


class WireCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)

    def add_in(self, kind: str, msg: Message) -> None:
        with self._lock:
            self.received[kind] += msg.ByteSize()

    def add_out(self, kind: str, msg: Message) -> None:
        with self._lock:
            self.sent[kind] += msg.ByteSize()

    def count_in(self, kind: str, messages: Iterable[M]) -> Iterator[M]:
        for msg in messages:
            self.add_in(kind, msg)
            yield msg

    def count_out(self, kind: str, messages: Iterable[M]) -> Iterator[M]:
        for msg in messages:
            self.add_out(kind, msg)
            yield msg

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return sum(self.received.values()), sum(self.sent.values())

    def by_kind(self) -> dict[str, dict[str, int]]:
        with self._lock:
            kinds = sorted(set(self.received) | set(self.sent))
            return {k: {"received": self.received.get(k, 0), "sent": self.sent.get(k, 0)} for k in kinds}
