"""Bytes on the wire, per RPC kind, per role and direction, counted where every message passes: here.

A message costs its serialized protobuf size plus gRPC's 5-byte length prefix plus the 9-byte
header of every HTTP/2 DATA frame it fills (16 KiB frames, the HTTP/2 default). Each call also
costs its HEADERS and trailers frames; HPACK shrinks those to a few dozen bytes once a
connection has seen them, so they are counted as CALL_OVERHEAD_BYTES per call (an estimate:
`benchmarks/wire_check.py` compares these counts with the bytes a TCP proxy sees).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

GRPC_PREFIX_BYTES = 5
HTTP2_FRAME_HEADER_BYTES = 9
HTTP2_MAX_FRAME_BYTES = 16384
CALL_OVERHEAD_BYTES = 100  # HPACK'd request HEADERS + response HEADERS + trailers, both ways
# The ledger meta key the counts are kept under across coordinator lives (WireCounter.snapshot).
WIRE_COUNTS = "wire_counts"

# RPCs only one role makes; join, heartbeat and leave are attributed by the caller.
ROLE_OF_KIND = {
    "lease_chunk": "data",
    "complete_chunk": "data",
    "fail_chunk": "data",
    "lease_shard": "compute",
    "report_shard": "compute",
    "init": "compute",
    "pull": "compute",
    "pull_join": "compute",
    "push": "compute",
    "eval_pull": "evaluator",
    "report_eval": "evaluator",
    "finish": "observer",
    "status": "observer",
}


def framed_bytes(message_bytes: int) -> int:
    """What one gRPC message of `message_bytes` costs on an HTTP/2 stream."""
    payload = message_bytes + GRPC_PREFIX_BYTES
    frames = max(1, -(-payload // HTTP2_MAX_FRAME_BYTES))
    return payload + frames * HTTP2_FRAME_HEADER_BYTES


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field_len(payload: int) -> int:
    """A length-delimited field (1-byte tag) holding `payload` bytes."""
    return 1 + _varint_len(payload) + payload


def message_size(msg: Message) -> int:
    """msg.ByteSize(), without serializing a tensor piece to learn it (upb's ByteSize encodes
    the message: a copy of every megabyte received, just to count it)."""
    piece = getattr(msg, "piece", None)
    if piece is None or msg.WhichOneof("kind") != "piece":
        return msg.ByteSize()
    data_len = len(piece.data)  # upb copies a bytes field on every access: read it once
    inner = _field_len(data_len) if data_len else 0
    inner += (1 + _varint_len(piece.tensor)) if piece.tensor else 0
    inner += (1 + _varint_len(piece.offset)) if piece.offset else 0
    return _field_len(inner)


class WireCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._role_in: dict[str, int] = defaultdict(int)
        self._role_out: dict[str, int] = defaultdict(int)

    def _role(self, kind: str, role: str | None) -> str:
        return role or ROLE_OF_KIND.get(kind, "unknown")

    def call(self, kind: str, role: str | None = None) -> None:
        """One RPC started: its HEADERS and trailers, split evenly between the directions."""
        r = self._role(kind, role)
        with self._lock:
            self.calls[kind] += 1
            self.received[kind] += CALL_OVERHEAD_BYTES // 2
            self.sent[kind] += CALL_OVERHEAD_BYTES - CALL_OVERHEAD_BYTES // 2
            self._role_in[r] += CALL_OVERHEAD_BYTES // 2
            self._role_out[r] += CALL_OVERHEAD_BYTES - CALL_OVERHEAD_BYTES // 2

    def add_in(self, kind: str, msg: Message, role: str | None = None) -> None:
        self.add_in_bytes(kind, message_size(msg), role)

    def add_in_bytes(self, kind: str, message_bytes: int, role: str | None = None) -> None:
        """One received message of `message_bytes` serialized bytes."""
        n = framed_bytes(message_bytes)
        r = self._role(kind, role)
        with self._lock:
            self.received[kind] += n
            self._role_in[r] += n

    def add_out(self, kind: str, msg: Message, role: str | None = None) -> None:
        n = framed_bytes(message_size(msg))
        r = self._role(kind, role)
        with self._lock:
            self.sent[kind] += n
            self._role_out[r] += n

    def unary_in(self, kind: str, msg: Message, role: str | None = None) -> None:
        """A unary call's request: the call itself and its message."""
        self.call(kind, role)
        self.add_in(kind, msg, role)

    def count_out(self, kind: str, messages: Iterable[M]) -> Iterator[M]:
        for msg in messages:
            self.add_out(kind, msg)
            yield msg

    def totals(self, exclude_roles: Iterable[str] = ("observer", "evaluator")) -> tuple[int, int]:
        """(received, sent) of the job's own traffic: monitoring (observers, evaluators) is left out."""
        skip = set(exclude_roles)
        with self._lock:
            return (
                sum(n for r, n in self._role_in.items() if r not in skip),
                sum(n for r, n in self._role_out.items() if r not in skip),
            )

    def by_kind(self) -> dict[str, dict[str, int]]:
        with self._lock:
            kinds = sorted(set(self.received) | set(self.sent))
            return {
                k: {
                    "received": self.received.get(k, 0),
                    "sent": self.sent.get(k, 0),
                    "calls": self.calls.get(k, 0),
                }
                for k in kinds
            }

    def by_role(self) -> dict[str, dict[str, int]]:
        with self._lock:
            roles = sorted(set(self._role_in) | set(self._role_out))
            return {r: {"received": self._role_in.get(r, 0), "sent": self._role_out.get(r, 0)} for r in roles}

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Every count, for the ledger: a restarted coordinator goes on from them (restore)."""
        with self._lock:
            return {
                "received": dict(self.received), "sent": dict(self.sent), "calls": dict(self.calls),
                "role_in": dict(self._role_in), "role_out": dict(self._role_out),
            }  # fmt: skip

    def restore(self, saved: Mapping[str, Mapping[str, int]]) -> None:
        """Add an earlier life's counts (snapshot's): the run's wire bytes are every life's."""
        with self._lock:
            for table, counts in (
                (self.received, saved.get("received", {})), (self.sent, saved.get("sent", {})),
                (self.calls, saved.get("calls", {})), (self._role_in, saved.get("role_in", {})),
                (self._role_out, saved.get("role_out", {})),
            ):  # fmt: skip
                for key, n in counts.items():
                    table[str(key)] += int(n)


def job_wire_bytes(saved: Mapping[str, Mapping[str, int]] | None) -> tuple[int, int]:
    """(the job's own wire bytes, of them its learners' joins: init and first pulls) in a snapshot,
    monitoring left out as WireCounter.totals does: what a resumed job subtracts from the run's."""
    if not saved:
        return 0, 0
    counter = WireCounter()
    counter.restore(saved)
    joining = sum(counter.received.get(k, 0) + counter.sent.get(k, 0) for k in ("init", "pull_join"))
    return sum(counter.totals()), joining


class CountRequestStreams(grpc.ServerInterceptor):
    """Counts each message of the named client-streaming RPCs where gRPC deserializes it.

    Its serialized length is right there for free; measuring a parsed piece instead reads its
    `data`, which upb copies on every access (a megabyte per piece on the push path). The
    handlers count only the call itself (WireCounter.call). With `parse`, that parses the
    messages instead of the handler's own deserializer (wire.tensors.parse_stream_message reads
    pieces in place).
    """

    def __init__(
        self, wire: WireCounter, kinds: Mapping[str, str], parse: Callable[[bytes], Any] | None = None
    ) -> None:
        self._wire = wire
        self._kinds = dict(kinds)  # "/package.Service/Method" -> kind
        self._parse = parse

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        kind = self._kinds.get(handler_call_details.method)
        if handler is None or kind is None or not handler.request_streaming:
            return handler
        parse, wire = self._parse or handler.request_deserializer, self._wire

        def counted(raw: bytes) -> Any:
            wire.add_in_bytes(kind, len(raw))
            return parse(raw)

        return handler._replace(request_deserializer=counted)
