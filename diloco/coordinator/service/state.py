"""The service's in-memory state: each fragment's head and open round, and the constants every
handler shares."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch

from diloco.coordinator import merging, syncer
from diloco.coordinator.ledger import MergeRecord
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.coordinator")

ROLE_NAMES = {
    pb.ROLE_DATA: "data",
    pb.ROLE_COMPUTE: "compute",
    pb.ROLE_OBSERVER: "observer",
    pb.ROLE_EVALUATOR: "evaluator",
}
RUN_STATES = {
    "running": pb.RUN_STATE_RUNNING,
    "finishing": pb.RUN_STATE_FINISHING,
    "finished": pb.RUN_STATE_FINISHED,
}
_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# Client streams whose messages are counted as gRPC reads them (wirecount.CountRequestStreams).
STREAMED_REQUEST_KINDS = {f"/{_SERVICE}/PushDelta": "push", f"/{_SERVICE}/InitParameters": "init"}
MAX_PULL_WAIT_S = 30.0
PUSH_SLOT_WAIT_S = 10.0
# A push's header comes first and at once: a stream that sends none within this is cut, and none
# holds a push slot before its header is read and checked (two callers' silent streams held all 16).
PUSH_HEADER_WAIT_S = 10.0
NORM_HISTORY = 32  # accepted deltas' norms the outlier check keeps per fragment


@dataclass
class PendingPush:
    arrival: syncer.Arrival
    push_id: str
    mean_loss: float
    first_loss: float


@dataclass
class RoundSum:
    """The open round's deltas, folded in by the push handlers as they are accepted, so the
    coordinator holds one fragment per round however many learners push (plus the pushes in
    flight, which max_inflight_pushes bounds). `folding` handlers are still adding theirs."""

    acc: merging.MergeAccumulator
    lock: threading.Lock = field(default_factory=threading.Lock)
    folding: int = 0
    lost: list[str] = field(default_factory=list)  # push ids whose fold failed: the round is dropped


@dataclass
class FragmentState:
    index: int
    names: list[str]
    # The head: the newest merge, in memory (published or not); the next merge builds on it.
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    version: int
    round: syncer.RoundState
    sum: RoundSum
    pending: list[PendingPush] = field(default_factory=list)
    sealing: bool = False  # the merger is waiting for the round's last folds: new pushes wait
    # The last merged round's first push time and pushers: a push that opens the next round is
    # told how late it was for that one (syncer.missed_round_by).
    previous_round: tuple[float, frozenset[str]] | None = None
    # After a restart: the learners whose pushes to this fragment it dropped, and until when its
    # first round waits for them to send those again (syncer.decide_close).
    awaited: frozenset[str] = frozenset()
    awaited_until: float = 0.0
    # Published: checkpointed and committed, so learners may hold it. Merges between the
    # published version and the head wait for the publisher.
    published_version: int = 0
    unpublished: list[MergeRecord] = field(default_factory=list)
    files: list[int] = field(default_factory=list)  # versions with a checkpoint file, oldest first
    # What up-to-date learners hold: published Θ itself with fp32 pulls; with a pull codec, the
    # sum of the encoded deltas sent so far. Θ − broadcast is the coordinator's error feedback: it
    # goes out with the next delta, so the learners' copy never drifts from Θ.
    broadcast: dict[str, torch.Tensor] = field(default_factory=dict)
    # published version -> (the published version before it, the encoded blobs of the step
    # between their broadcasts), the last few.
    chain: dict[int, tuple[int, dict[str, bytes]]] = field(default_factory=dict)
    # The norms per H steps of the last accepted deltas of H steps or more (the outlier check,
    # limits.norm_outlier).
    # Restored from the ledger at a start (each push keeps its norm), so a restart does not empty it.
    recent_norms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=NORM_HISTORY)
    )
    recent_workers: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=NORM_HISTORY)
    )
    # The deviations per H steps of the same deltas from the fragment's mean step (centered_clip).
    recent_deviations: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=NORM_HISTORY)
    )
    param_norm: tuple[int, float] = (-1, 0.0)  # (version, ‖params‖ less running statistics)
    momentum_norm: tuple[int, float] = (-1, 0.0)  # (version, ‖momentum‖ less running statistics)


def moving_average(current: float, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average: the syncer's step, merge and publish times. The first
    sample (current 0) is taken as it is."""
    return sample if current == 0 else (1 - weight) * current + weight * sample


def stream_header(
    request_iterator: Iterator[pb.TensorStreamMessage], context: grpc.ServicerContext, error: str
) -> tuple[pb.TensorStreamMessage, Iterator[pb.TensorStreamMessage]]:
    """A tensor stream's first message, which must be its header, and the rest of the stream."""
    messages = iter(request_iterator)
    first = next(messages, None)
    if first is None or first.WhichOneof("kind") != "header":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
    return first, messages
