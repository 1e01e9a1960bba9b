"""A worker's connection to the coordinator: join, retries with jittered backoff, tensor streams.

Every worker role goes through this one class, so retry and re-join behaviour is the same
everywhere: transient failures (the coordinator restarting, a dropped connection) are retried
with jittered exponential backoff up to a deadline; "unknown worker" (the coordinator forgot us,
e.g. after we were declared lost) triggers one re-join. Pushes carry client-made ids, so a retry
after a lost reply has no second effect.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from diloco.config import CoordinatorConfig, RunConfig
from diloco.errors import DilocoError
from diloco.pull_clock import PullClock
from diloco.security.transport import (
    Security,
    client_channel,
    connect_cause,
    give_up_on_handshake,
    handshake_problem,
    http2_frame_bytes,
)
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # torch is imported by the roles that stream tensors, not by data workers
    import torch

log = logging.getLogger("diloco.client")

T = TypeVar("T")
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CLIENT_MESSAGE_LIMIT = 64 << 20
# How long a worker rides out a coordinator outage (a restart, a network cut) before giving up.
WORKER_OUTAGE_TOLERANCE_S = 600.0
# Reconnecting after the coordinator restarts (~0.3 s): gRPC's own schedule waits 1 s before its
# first new attempt and backs off to 2 minutes, and workers' calls were answered 2.2 s after a
# restart listened again on average, 0.3 s with these (benchmarks/reconnect.py). The floor of a
# connection attempt (grpc.min_reconnect_backoff_ms, 20 s) stays: lower, it cuts slow handshakes.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)]
# A worker started before its coordinator says once, after this long, what it waits for; a
# coordinator that comes up (or restarts) within it goes unmentioned.
WAIT_NOTICE_S = 2.0
# gRPC's own target schemes, passed through as they are.
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def check_address(address: str) -> str:
    """The coordinator's address if it is HOST:PORT ([IPv6]:PORT, or a gRPC target such as
    unix:PATH); else a clear error, not what gRPC does with it (no port: 443; 99999: 34463)."""
    if address.startswith(TARGET_SCHEMES):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise DilocoError(f"--coordinator {address!r}: expected HOST:PORT, such as 127.0.0.1:7777")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise DilocoError(f"--coordinator {address!r}: write an IPv6 address in brackets: [{host}]:{port}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise DilocoError(f"--coordinator {address!r}: the port must be a number from 1 to 65535")
    return address


class ClientClosed(DilocoError):
    """A call made after close(): the worker is stopping, not a failure to report."""


def backoff_delay(
    attempt: int, base_s: float = 0.2, cap_s: float = 5.0, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base·2^attempt)]."""
    rng = rng or random
    return rng.uniform(0, min(cap_s, base_s * (2**attempt)))


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        role: int,
        retry_deadline_s: float = 60.0,
        worker_id: str | None = None,
        security: Security | None = None,
    ):
        self.address = check_address(address)
        self.role = role
        self.retry_deadline_s = retry_deadline_s
        # mTLS, a token, or neither: given, else this process's (its flags put them in the environment).
        self.security = security if security is not None else Security.from_env()
        # With a certificate, the worker is who the certificate names.
        self.worker_id = (
            worker_id
            or self.security.name()
            or f"{_role_name(role)}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        )
        self.channel = client_channel(
            address,
            self.security,
            [
                ("grpc.max_send_message_length", CLIENT_MESSAGE_LIMIT),
                ("grpc.max_receive_message_length", CLIENT_MESSAGE_LIMIT),
                ("grpc.keepalive_time_ms", 20_000),
                # A pulled piece arrives as one HTTP/2 frame.
                ("grpc.http2.max_frame_size", http2_frame_bytes(CoordinatorConfig.stream_chunk_bytes)),
                *RECONNECT_OPTIONS,
            ],
        )
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.config: RunConfig | None = None
        self._join_lock = threading.RLock()
        self.join_reply: pb.JoinReply | None = None
        self.closed = False
        self.left = False  # after leave(), a coordinator that forgot us is not joined again
        self.ranks = 1  # a learner that is a torchrun group says how many ranks it has, at join
        self.pull_clock = PullClock()

    @property
    def stopping(self) -> bool:
        """Left or closed: background threads end instead of joining again or retrying."""
        return self.closed or self.left

    def close(self) -> None:
        # In-flight calls end CANCELLED and no retry starts: background threads wind down.
        self.closed = True
        self.channel.close()

    # -- connection -----------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> None:
        """Until the channel is up. A coordinator whose handshake keeps failing (its security and
        ours do not match) is named at once, with what to change, not after the whole timeout;
        one that does not answer is named once after WAIT_NOTICE_S, not only at the end."""
        ready = grpc.channel_ready_future(self.channel)
        notice_at = time.monotonic() + WAIT_NOTICE_S
        deadline = time.monotonic() + timeout_s
        failing_since: float | None = None
        try:
            while True:
                try:
                    ready.result(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                    return
                except grpc.FutureTimeoutError:
                    pass
                last_error = self._last_connect_error()
                problem = handshake_problem(last_error, self.security, self.address)
                failing_since, give_up = give_up_on_handshake(problem, failing_since, time.monotonic())
                if give_up:
                    raise DilocoError(f"cannot connect to the coordinator at {self.address}: {problem}")
                said = connect_cause(last_error)
                if not problem and time.monotonic() >= notice_at:
                    notice_at = float("inf")  # once
                    cause = said[:1].lower() + said[1:] if said else "no answer yet"
                    log.warning(
                        "waiting for the coordinator at %s (%s); up to %.0fs", self.address, cause, timeout_s
                    )
                if time.monotonic() >= deadline:
                    raise DilocoError(
                        f"cannot reach the coordinator at {self.address} (waited {timeout_s:.0f}s"
                        + (f"; last error: {said})" if said else ")")
                    )
        finally:
            ready.cancel()

    def _last_connect_error(self) -> str:
        """gRPC's last connection error: a call that does not wait for the channel ends with it."""
        try:
            self.stub.Status(pb.StatusRequest(), timeout=1.0, wait_for_ready=False)
        except grpc.RpcError as e:
            return e.details() or ""
        return ""

    def join(self, timeout_s: float = 30.0) -> pb.JoinReply:
        with self._join_lock:  # background threads may all find out at once that we must re-join
            return self._join(timeout_s)

    def _join(self, timeout_s: float) -> pb.JoinReply:
        self.wait_ready(timeout_s)
        request = pb.JoinRequest(
            role=self.role, host=socket.gethostname(), worker_id=self.worker_id, ranks=self.ranks
        )
        reply = self._retry(lambda: self.stub.Join(request, timeout=10.0), "join", rejoin=False)
        self.worker_id = reply.worker_id
        self.join_reply = reply
        self.config = RunConfig.from_json(reply.config_json)
        log.info("joined %s as %s epoch=%d", self.address, self.worker_id, reply.coordinator_epoch)
        return reply

    def _retry(
        self, fn: Callable[[], T], what: str, rejoin: bool = True, retry_for_s: float | None = None
    ) -> T:
        """fn(), tried again on transient errors until retry_for_s (default: the client's
        retry_deadline_s) has passed; 0: once, for callers that keep a retry loop of their own.
        A coordinator that forgot us is joined again once, whatever the deadline."""
        deadline = time.monotonic() + (self.retry_deadline_s if retry_for_s is None else retry_for_s)
        attempt = 0
        rejoined = False
        failing_since: float | None = None
        while True:
            try:
                result = fn()
            except ValueError as e:
                # grpc raises ValueError for a call on a channel close() already shut: a background
                # thread that was between calls when the worker stopped.
                if self.closed:
                    raise ClientClosed(f"{what}: the client was closed") from e
                raise
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.NOT_FOUND and rejoin and not rejoined and not self.stopping:
                    log.warning("%s: coordinator does not know us (%s); joining again", what, e.details())
                    self.join()
                    rejoined = True
                    continue
                if self.stopping or code not in RETRYABLE or time.monotonic() >= deadline:
                    raise
                delay = backoff_delay(attempt)
                if failing_since is None:  # said once per call: an outage is not a log line a second
                    failing_since = time.monotonic()
                    log.info(
                        "%s failed (%s); retrying for up to %.0fs", what, code.name, deadline - failing_since
                    )
                else:
                    log.debug("%s failed (%s); retrying in %.2fs", what, code.name, delay)
                time.sleep(delay)
                attempt += 1
            else:
                if failing_since is not None:
                    log.info(
                        "%s answered after %.1fs (%d retries)",
                        what,
                        time.monotonic() - failing_since,
                        attempt,
                    )
                return result

    def call(
        self, method: str, request: Any, timeout_s: float = 30.0, retry_for_s: float | None = None
    ) -> Any:
        """A unary RPC with retries (for `retry_for_s`, default the client's deadline); `worker_id`
        is filled in when the request has one."""
        rpc = getattr(self.stub, method)

        def once() -> Any:
            if hasattr(request, "worker_id"):
                request.worker_id = self.worker_id
            return rpc(request, timeout=timeout_s)

        return self._retry(once, method, retry_for_s=retry_for_s)

    def call_once(self, method: str, request: Any, timeout_s: float = 5.0) -> Any:
        """A unary RPC tried once, with a short timeout: the last words of a worker that is
        stopping, which must not hold its exit up for the outage tolerance when nobody answers."""
        if hasattr(request, "worker_id"):
            request.worker_id = self.worker_id
        return getattr(self.stub, method)(request, timeout=timeout_s)

    # -- the unary RPCs, typed ------------------------------------------------------------------

    def heartbeat(self, request: pb.HeartbeatRequest, timeout_s: float = 10.0) -> pb.HeartbeatReply:
        return self.call("Heartbeat", request, timeout_s)

    def last_heartbeat(self, request: pb.HeartbeatRequest, timeout_s: float = 5.0) -> pb.HeartbeatReply:
        """Tried once: a stopping worker's final counters must not hold its exit up."""
        return self.call_once("Heartbeat", request, timeout_s)

    def lease_chunk(self) -> pb.LeaseChunkReply:
        return self.call("LeaseChunk", pb.LeaseChunkRequest())

    def complete_chunk(self, request: pb.CompleteChunkRequest) -> pb.CompleteChunkReply:
        return self.call("CompleteChunk", request)

    def fail_chunk(self, chunk_id: int, error: str) -> pb.FailChunkReply:
        return self.call("FailChunk", pb.FailChunkRequest(chunk_id=chunk_id, error=error))

    def lease_shard(self) -> pb.LeaseShardReply:
        return self.call("LeaseShard", pb.LeaseShardRequest())

    def report_shard(self, shard_id: int, error: str) -> pb.ReportShardReply:
        return self.call("ReportShard", pb.ReportShardRequest(shard_id=shard_id, error=error))

    def report_eval(self, request: pb.ReportEvalRequest) -> pb.ReportEvalReply:
        return self.call("ReportEval", request)

    def finish(self, reason: str, timeout_s: float = 30.0) -> pb.FinishReply:
        return self.call("Finish", pb.FinishRequest(reason=reason), timeout_s)

    def status(
        self, timeout_s: float = 10.0, once: bool = False, retry_for_s: float | None = None
    ) -> dict[str, Any]:
        """The coordinator's status detail; `once`: no retries (a monitor that asks again anyway)."""
        if once:
            reply = self.call_once("Status", pb.StatusRequest(), timeout_s)
        else:
            reply = self.call("Status", pb.StatusRequest(), timeout_s, retry_for_s=retry_for_s)
        return json.loads(reply.detail_json)

    # -- tensors --------------------------------------------------------------------------------

    def _piece_bytes(self) -> int:
        return self.config.coordinator.stream_chunk_bytes if self.config else 1 << 20

    def init_parameters(
        self, tensors: Mapping[str, torch.Tensor], averaged: frozenset[str] = frozenset()
    ) -> pb.InitParametersReply:
        """The run's initial tensors; `averaged`: those that are running statistics (merged as a
        plain mean)."""
        from diloco.wire.tensors import stream_tensors  # torch: only roles that stream tensors

        def once() -> pb.InitParametersReply:
            header = pb.TensorHeader(worker_id=self.worker_id)
            return self.stub.InitParameters(
                stream_tensors(header, tensors, self._piece_bytes(), averaged), timeout=300.0
            )

        return self._retry(once, "init")

    def push(
        self,
        header: pb.TensorHeader,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float = 300.0,
        retry_for_s: float | None = None,
    ) -> pb.PushReply:
        """Stream one delta. The same push_id on every retry makes a lost reply harmless."""
        from diloco.wire.tensors import stream_tensors

        if not header.push_id:
            header.push_id = uuid.uuid4().hex

        def once() -> pb.PushReply:
            header.worker_id = self.worker_id
            return self.stub.PushDelta(
                stream_tensors(header, tensors, self._piece_bytes()), timeout=timeout_s
            )

        return self._retry(once, "push", retry_for_s=retry_for_s)

    def pull(
        self,
        fragments: list[int],
        have_versions: list[int] | None = None,
        wait_s: float = 0.0,
        wait_above: list[int] | None = None,
        retry_for_s: float | None = None,
    ) -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
        """Fragments newer than the versions held (all wanted ones when none are held); with
        wait_above, long-poll until a fragment passes that version (deltas still start at `have`)."""
        from diloco.wire.tensors import receive_groups

        request = pb.PullRequest(
            fragments=fragments, have_versions=have_versions or [], wait_s=wait_s, wait_above=wait_above or []
        )

        def once() -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
            request.worker_id = self.worker_id
            stream = self.stub.PullParameters(request, timeout=wait_s + 300.0)
            groups = list(receive_groups(self.pull_clock.timed(stream), max_bytes=1 << 40))
            self.pull_clock.count(len(groups))
            return groups

        return self._retry(once, "pull", retry_for_s=retry_for_s)

    def leave(self, reason: str = "") -> None:
        self.left = True
        try:
            self.stub.Leave(pb.LeaveRequest(worker_id=self.worker_id, reason=reason), timeout=5.0)
        except grpc.RpcError as e:
            log.info("leave not delivered (%s)", e.code().name)


def _role_name(role: int) -> str:
    names = {pb.ROLE_DATA: "data", pb.ROLE_COMPUTE: "learner", pb.ROLE_OBSERVER: "observer"}
    return {**names, pb.ROLE_EVALUATOR: "evaluator"}.get(role, "worker")
