"""What the learner's sync loops make of a failed call (rpc_outcome): a refusal of this learner
ends it at once with one line; an outage is retried and counted toward sync.max_unreachable_s."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from diloco.compute import schedule
from diloco.compute.rpc_outcome import Action, rpc_outcome
from diloco.compute.sync_channel import SyncChannel
from diloco.errors import DilocoError
from diloco.v1 import coordinator_pb2 as pb
from tests.unit.compute.test_keep_overlap import learner_with_one_tensor

S = grpc.StatusCode
# code -> (action, the coordinator counts as reachable)
DECISIONS = {
    S.OK: (Action.RETRY, True),
    S.CANCELLED: (Action.RETRY, False),  # a stalled stream the coordinator cut
    S.UNKNOWN: (Action.RETRY, True),
    S.INVALID_ARGUMENT: (Action.MALFORMED, True),
    S.DEADLINE_EXCEEDED: (Action.RETRY, False),
    S.NOT_FOUND: (Action.RETRY, True),  # the client joins again inside the next call
    S.ALREADY_EXISTS: (Action.RETRY, True),
    S.PERMISSION_DENIED: (Action.FATAL, True),
    S.RESOURCE_EXHAUSTED: (Action.RETRY, True),  # push slots full: busy, not gone
    S.FAILED_PRECONDITION: (Action.RETRY, True),  # no parameters yet: a learner initializes them
    S.ABORTED: (Action.RETRY, True),
    S.OUT_OF_RANGE: (Action.RETRY, True),
    S.UNIMPLEMENTED: (Action.FATAL, True),
    S.INTERNAL: (Action.RETRY, True),
    S.UNAVAILABLE: (Action.RETRY, False),
    S.DATA_LOSS: (Action.RETRY, True),
    S.UNAUTHENTICATED: (Action.FATAL, True),
}


def test_the_table_covers_every_status_code():
    assert set(DECISIONS) == set(grpc.StatusCode)


@pytest.mark.parametrize("code", list(DECISIONS), ids=lambda c: c.name)
def test_each_code_has_one_decision_with_a_reason(code):
    outcome = rpc_outcome(code, "what the coordinator said")
    assert (outcome.action, outcome.reachable) == DECISIONS[code]
    if code not in (S.UNAVAILABLE, S.DEADLINE_EXCEEDED):  # those say no more than their name
        assert "what the coordinator said" in outcome.reason
    assert code.name in rpc_outcome(code, "").reason or outcome.action is not Action.RETRY


def test_a_refused_identity_points_at_the_flags_that_give_it():
    for code in (S.PERMISSION_DENIED, S.UNAUTHENTICATED):
        assert "--tls-cert/--token-file" in rpc_outcome(code, "").reason
    # A revoked certificate is not a flag to fix: it says who revoked it, and what lets a learner in.
    revoked = rpc_outcome(S.PERMISSION_DENIED, "the certificate of l (learner, serial 1a) is revoked").reason
    assert "operator revoked this certificate" in revoked and "--tls-cert" not in revoked


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeClient:
    """Pushes fail with `push_error` (None: accepted); pulls with `pull_error` (None: nothing yet)."""

    def __init__(self, push_error: grpc.RpcError | None = None, pull_error: grpc.RpcError | None = None):
        self.push_error, self.pull_error = push_error, pull_error
        self.closed = False
        self.pushes = 0
        self.pulls = 0

    def push(self, header, tensors, retry_for_s=None) -> pb.PushReply:
        self.pushes += 1
        if self.push_error is not None:
            raise self.push_error
        return pb.PushReply(accepted=True, version=header.version)

    def pull(self, fragments, have, wait_s, wait_above, retry_for_s=None):
        self.pulls += 1
        if self.pull_error is not None:
            raise self.pull_error
        time.sleep(0.05)
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def a_push() -> pb.TensorHeader:
    return pb.TensorHeader(fragment=0, version=0, push_id="p1", codec="fp32")


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def running(client: FakeClient, clock: Clock | None = None) -> tuple[SyncChannel, threading.Event]:
    stop = threading.Event()
    channel = SyncChannel(client, stop, pull_wait_s=0.1, held=lambda p: 0, clock=clock or Clock())  # type: ignore[arg-type]
    channel.start()
    return channel, stop


def test_a_push_refused_for_this_learners_identity_ends_it_at_once_with_one_line():
    client = FakeClient(
        push_error=Refusal(S.PERMISSION_DENIED, "worker 'learner-0' belongs to another caller")
    )
    channel, stop = running(client)
    try:
        channel.submit(a_push(), {"w": torch.ones(2)})
        assert wait_until(lambda: channel.refused is not None, 2.0), "the channel kept retrying"
        time.sleep(0.3)  # a retry would come within the first backoff (0.2 s at most)
        assert client.pushes == 1
        with pytest.raises(DilocoError) as refused:
            channel.check()
        line = str(refused.value)
        assert "refuses this learner's pushes" in line and "belongs to another caller" in line
        assert "--tls-cert/--token-file" in line and "\n" not in line
        assert channel.unreachable_for() == 0  # it answered: not an outage
        # Synchronous mode's wait does not sit out its timeout for a merge that cannot come.
        started = time.monotonic()
        with pytest.raises(DilocoError):
            channel.wait_any(10.0)
        assert time.monotonic() - started < 1.0
        # Later pushes are not sent (each would be refused); the queue drains, so the end's
        # flush does not wait on it.
        channel.submit(a_push(), {"w": torch.ones(2)})
        assert wait_until(channel.idle, 2.0)
        assert client.pushes == 1
    finally:
        stop.set()
        channel.join(5)


def test_a_pull_refused_for_this_learners_token_ends_it_the_same_way():
    client = FakeClient(pull_error=Refusal(S.UNAUTHENTICATED, "the token does not match this coordinator's"))
    channel, stop = running(client)
    try:
        channel.submit(a_push(), {"w": torch.ones(2)})  # accepted: its merge is pulled for
        assert wait_until(lambda: channel.refused is not None, 2.0), "the puller kept retrying"
        assert client.pulls == 1
        with pytest.raises(DilocoError, match="refuses this learner's pulls: the token does not match"):
            channel.check()
    finally:
        stop.set()
        channel.join(5)


def test_an_unavailable_coordinator_is_retried_and_counted_as_unreachable():
    clock = Clock()
    client = FakeClient(push_error=Refusal(S.UNAVAILABLE, "connection refused"))
    channel, stop = running(client, clock)
    try:
        channel.submit(a_push(), {"w": torch.ones(2)})
        assert wait_until(lambda: client.pushes >= 3), "the push was not retried"
        channel.check()  # not a refusal: the learner goes on
        assert channel.refused is None
        clock.now += 400
        assert channel.unreachable_for() == pytest.approx(400)
        assert schedule.must_block(channel.unreachable_for(), 300.0)  # sync.max_unreachable_s acts
    finally:
        stop.set()
        channel.join(5)


def test_a_busy_coordinator_answered_so_a_pull_refused_for_room_is_no_outage():
    # The puller used to count any failed call as unreachable, the pusher only UNAVAILABLE and
    # DEADLINE_EXCEEDED: one decision now, and a coordinator that says "retry shortly" is there.
    clock = Clock()
    client = FakeClient(pull_error=Refusal(S.RESOURCE_EXHAUSTED, "8 pull calls open already; retry shortly"))
    channel, stop = running(client, clock)
    try:
        channel.submit(a_push(), {"w": torch.ones(2)})
        assert wait_until(lambda: client.pulls >= 2), "the pull was not retried"
        clock.now += 400
        assert channel.unreachable_for() == 0
        assert channel.refused is None
    finally:
        stop.set()
        channel.join(5)


def test_the_learner_ends_on_the_channels_refusal_with_its_line_and_leaves_refused(monkeypatch):
    learner = learner_with_one_tensor(keep=False)
    stop = threading.Event()
    client = FakeClient(push_error=Refusal(S.PERMISSION_DENIED, "caller learner-9 may not push"))
    learner.channel = SyncChannel(client, stop, pull_wait_s=0.1, held=lambda p: 0)  # type: ignore[arg-type]
    learner.channel.start()
    learner.channel.submit(a_push(), {"w": torch.ones(2)})
    assert wait_until(lambda: learner.channel.refused is not None, 2.0)
    left: list[str] = []
    monkeypatch.setattr(learner, "_setup", lambda: learner.cfg)
    monkeypatch.setattr(learner, "_start", lambda: threading.Thread(target=lambda: None))
    monkeypatch.setattr(learner, "_leave", lambda reason, heartbeats: left.append(reason))
    try:
        with pytest.raises(DilocoError, match="refuses this learner's pushes: caller learner-9 may not push"):
            learner.run()  # the CLI prints a DilocoError as one line and exits 2 (cli.common)
        assert left and left[0].startswith("refused: the coordinator refuses this learner's pushes")
    finally:
        stop.set()
        learner.channel.join(5)
