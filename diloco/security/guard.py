"""The server's side of identity: every RPC checked before its handler runs (diloco.security.
transport says how each mode works). Under mutual TLS the caller's certificate gives its role and
name: the role decides which RPCs it may make, the name which worker it may act as."""

from __future__ import annotations

import functools
import hmac
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from diloco.plugins import a_or_an
from diloco.security.certs import subject_of
from diloco.security.revocation import revoked_refusal, serial_of
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb

# Who may call what (the certificate's role); Status is anyone's with an identity.
ANY = ("learner", "data", "evaluator", "observer", "operator")
ALLOWED: dict[str, tuple[str, ...]] = {
    "Join": ANY, "Heartbeat": ANY, "Leave": ANY, "Status": ANY,
    "LeaseChunk": ("data",), "CompleteChunk": ("data",), "FailChunk": ("data",),
    "LeaseShard": ("learner",), "ReportShard": ("learner",), "InitParameters": ("learner",),
    "PushDelta": ("learner",), "PullParameters": ("learner", "evaluator"),
    "ReportEval": ("evaluator",), "Finish": ("operator",),
}  # fmt: skip
# The role a certificate must hold to join as each Role.
JOIN_ROLE = {pb.ROLE_COMPUTE: ("learner",), pb.ROLE_DATA: ("data",), pb.ROLE_EVALUATOR: ("evaluator",),
             pb.ROLE_OBSERVER: ("observer", "operator")}  # fmt: skip


def caller_problem(method: str, role: str, name: str, request: Any) -> str:
    """Why this caller may not make this call ("" when it may): its role, and in the request the
    worker id it acts as (its certificate's name) and, at join, the role it joins as."""
    if role not in ALLOWED.get(method, ()):
        return f"{a_or_an(role) if role else 'a certificate without a role'} may not call {method}"
    worker_id = getattr(request, "worker_id", None)
    if worker_id and worker_id != name:
        return f"{name} ({role}) may not act as {worker_id!r}"
    if method == "Join" and role not in JOIN_ROLE.get(request.role, ()):
        return f"{a_or_an(role)} certificate may not join as {pb.Role.Name(request.role)}"
    return ""


# What a caller refused in token mode is told, by whether it sent a token at all.
TOKEN_REFUSALS = {
    True: "this coordinator needs its token: give --token-file (the run's token)",
    False: "the token does not match this coordinator's: is --token-file the run's token?",
}


class Guard(grpc.ServerInterceptor):
    """Every RPC checked before its handler runs: the token, or the certificate's role and name."""

    def __init__(
        self,
        security: Security,
        on_refused: Callable[[str, str, str], None] | None = None,
        on_revoked: Callable[[str, str], None] | None = None,
    ):
        """`on_refused(method, why, peer)`: each refused call, with where it came from;
        `on_revoked(role, name)`: each call of a revoked certificate, before it is refused."""
        self.security = security
        self.on_refused = on_refused or (lambda method, why, peer: None)
        self.on_revoked = on_revoked or (lambda role, name: None)
        self._subjects: dict[bytes, tuple[str, str, int]] = {}

    def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        method = details.method.rsplit("/", 1)[-1]
        if self.security.mode == "token":
            sent = dict(details.invocation_metadata or ()).get("authorization", "")
            handler = continuation(details)
            # The token file's latest, and for a while after a rotation the one before it: each
            # compared in constant time, and every one of them, whichever matches.
            taken = self.security.tokens.accepted(time.monotonic())
            if handler is None or any(
                [hmac.compare_digest(sent.encode(), f"Bearer {t}".encode()) for t in taken]
            ):
                return handler
            # Whether a token came says nothing of the right one; the comparison stays constant-time.
            missing = not sent.removeprefix("Bearer").strip()
            counted = functools.partial(self.on_refused, method, "no token" if missing else "a wrong token")
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSALS[missing], counted)
        handler = continuation(details)
        if self.security.mode != "mtls" or handler is None:
            return handler
        return self._checked(handler, method)

    def _subject(self, context: grpc.ServicerContext, method: str) -> tuple[str, str]:
        """The caller's (role, name), or a refusal of a certificate revoked (--tls-crl)."""
        pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
        if pem not in self._subjects:
            self._subjects[pem] = (*subject_of(pem), serial_of(pem)) if pem else ("", "", -1)
        role, name, serial = self._subjects[pem]
        revocations = self.security.revocations
        if revocations is not None and revocations.revoked(serial, time.monotonic()):
            self.on_revoked(role, name)
            self._deny(context, method, revoked_refusal(role, name, serial))
        return role, name

    def _deny(self, context: grpc.ServicerContext, method: str, why: str) -> None:
        self.on_refused(method, why, context.peer())
        context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _checked(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                role, name = self._subject(context, method)
                if why := caller_problem(method, role, name, request):
                    self._deny(context, method, why)
                return inner(request, context)

            kind = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.unary_stream_rpc_method_handler
            )
            return kind(unary, handler.request_deserializer, handler.response_serializer)

        inner_stream = handler.stream_unary

        def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            role, name = self._subject(context, method)
            if why := caller_problem(method, role, name, None):
                self._deny(context, method, why)
            return inner_stream(_header_checked(requests, name, role, method, self, context), context)

        return grpc.stream_unary_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )


def _header_checked(
    requests: Iterator[Any], name: str, role: str, method: str, guard: Guard, context: Any
) -> Iterator[Any]:
    """A streamed push or init: its header (the first message) must be the caller's own."""
    for i, message in enumerate(requests):
        header = message.header if i == 0 and message.WhichOneof("kind") == "header" else None
        if header is not None and header.worker_id and header.worker_id != name:
            guard._deny(context, method, f"{name} ({role}) may not act as {header.worker_id!r}")
        yield message


def _refusal(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str, counted: Callable[[str], None]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call, `counted` with its peer (which
    only the call's context knows: the interceptor sees the method and metadata alone)."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        counted(context.peer())
        context.abort(code, why)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )
