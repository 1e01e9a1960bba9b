"""How roles reach the coordinator safely: mutual TLS, or a shared token, or (on loopback) neither.

    mtls   every connection is TLS and carries a client certificate signed by the run's CA; the
           coordinator takes the caller's role and name from it (diloco.security.certs): a
           learner's certificate cannot lease chunks, nor heartbeat for another learner
    token  every call carries `authorization: Bearer <token>`, compared in constant time; the
           token's holders are trusted alike (a small set-up's shortcut)
    none   plaintext, no identity: refused beyond loopback unless --insecure says so

A role's settings come from its flags (`--tls-cert/--tls-key/--tls-ca`, `--token-file`,
`--insecure`), which the CLI puts in the environment (DILOCO_TLS_CERT, DILOCO_TLS_KEY,
DILOCO_TLS_CA, DILOCO_TOKEN, DILOCO_INSECURE), where every client of the process finds them.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from diloco.clock import lasting
from diloco.errors import DilocoError
from diloco.plugins import a_or_an
from diloco.security.certs import TlsFiles, serving_problem, subject_of
from diloco.v1 import coordinator_pb2 as pb

ENV = {"cert": "DILOCO_TLS_CERT", "key": "DILOCO_TLS_KEY", "ca": "DILOCO_TLS_CA"}
TOKEN_ENV, TOKEN_FILE_ENV, INSECURE_ENV = "DILOCO_TOKEN", "DILOCO_TOKEN_FILE", "DILOCO_INSECURE"

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


@dataclass(frozen=True)
class Security:
    tls: TlsFiles | None = None
    token: str = ""
    insecure: bool = False

    @property
    def mode(self) -> str:
        return "mtls" if self.tls else "token" if self.token else "none"

    @classmethod
    def from_env(cls) -> Security:
        paths = {k: os.environ.get(v, "") for k, v in ENV.items()}
        if any(paths.values()) and not all(paths.values()):
            raise DilocoError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        token = os.environ.get(TOKEN_ENV, "")
        if not token and os.environ.get(TOKEN_FILE_ENV):
            token = read_token(os.environ[TOKEN_FILE_ENV])
        return cls(
            TlsFiles(**paths) if all(paths.values()) else None, token, os.environ.get(INSECURE_ENV) == "1"
        )

    def to_env(self) -> dict[str, str]:
        env = {ENV[k]: getattr(self.tls, k) for k in ENV} if self.tls else {}
        if self.token:
            env[TOKEN_ENV] = self.token
        if self.insecure:
            env[INSECURE_ENV] = "1"
        return env

    def name(self) -> str | None:
        """The name in this role's certificate (its worker id), if it has one."""
        return subject_of(Path(self.tls.cert).read_bytes())[1] if self.tls else None


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise DilocoError(f"cannot read the token file: {e}") from e
    if len(token) < 16:
        raise DilocoError(f"{path}: a token must be at least 16 characters")
    return token


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_listen(host: str, security: Security) -> str:
    """Refuse to serve plaintext beyond loopback (anyone reaching the port would drive the run);
    returns a warning to print when --insecure allows it anyway."""
    if security.mode != "none" or is_loopback(host):
        return ""
    if not security.insecure:
        raise DilocoError(
            f"listening on {host} without TLS or a token lets anyone who reaches the port drive the run: "
            "give --tls-cert/--tls-key/--tls-ca (diloco certs) or --token-file, or --insecure to accept it"
        )
    return (
        f"serving on {host} without TLS or a token (--insecure): anyone who reaches the port drives the run"
    )


def check_serving(security: Security) -> None:
    """Refuse, at start, a certificate that clients would refuse from a server (a learner's, say):
    otherwise the coordinator listens and every client fails its handshake."""
    if not security.tls:
        return
    cert, _, _ = security.tls.read()
    if problem := serving_problem(cert):
        ca_dir = Path(security.tls.ca).parent
        raise DilocoError(
            f"--tls-cert {security.tls.cert} {problem}; give the coordinator its own: "
            f"diloco certs issue --out {ca_dir} --role coordinator --name coordinator --host <its address>"
        )


# -- the client's side -------------------------------------------------------------------------

# How long a connection must keep failing its handshake before a client stops waiting: a
# coordinator killed mid-handshake fails one attempt, never every attempt for seconds (gRPC
# retries after 1 s, then 1.6 s, ...), while a client whose security does not match the
# coordinator's would wait out its whole connect timeout and learn only "cannot reach".
HANDSHAKE_PATIENCE_S = 2.5


def handshake_problem(last_error: str, security: Security) -> str:
    """What gRPC's last connection error says about the two ends' security ("" when it is not a
    handshake's failure: a coordinator that is down refuses the TCP connection instead)."""
    if "Tls handshake failed" in last_error or "Ssl handshake failed" in last_error:
        if "WRONG_VERSION_NUMBER" in last_error:
            return "the coordinator does not speak TLS: drop --tls-cert/--tls-key/--tls-ca, or start it with them"
        if "unsupported certificate purpose" in last_error:
            return (
                "the coordinator's certificate is not a server's (unsupported certificate purpose): "
                "restart it with one from `diloco certs issue --role coordinator`"
            )
        return (
            "the TLS handshake failed (is the coordinator's certificate signed by your --tls-ca?): "
            + last_error.rsplit("handshake failed", 1)[-1].removesuffix(": OK").strip(" :")[:200]
        )
    if "Socket closed" in last_error or "Connection reset by peer" in last_error:
        if security.tls:
            return (
                "the coordinator closed the connection during the TLS handshake: it does not trust "
                "your certificate (issued by another CA?)"
            )
        return (
            "the coordinator closed the connection before it began: it runs TLS, so give "
            "--tls-cert/--tls-key/--tls-ca (a certificate from its CA: diloco certs issue)"
        )
    return ""


def connect_cause(last_error: str) -> str:
    """The end of gRPC's last connection error, what a person can act on: "Connection refused",
    "Domain name not found" (without the brackets gRPC nests resolver errors in)."""
    return last_error.rsplit(": ", 1)[-1].strip(" []")[:200]


def give_up_on_handshake(problem: str, failing_since: float | None, now: float) -> tuple[float | None, bool]:
    """(when the handshake began failing, whether to stop waiting): a problem that has lasted
    HANDSHAKE_PATIENCE_S; any other state (refused, connecting) starts the count again."""
    since, lasted = lasting(bool(problem), failing_since, now)
    return since, since is not None and lasted >= HANDSHAKE_PATIENCE_S


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # fmt: skip
    """Adds the token to every call's metadata."""

    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> _CallDetails:
        metadata = [*(d.metadata or []), self.header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)


def http2_frame_bytes(piece: int) -> int:
    """The largest HTTP/2 frame an end accepts: one streamed piece in one frame rather than in
    HTTP/2's default 16 KiB frames (64 per MiB). That takes about a tenth off gRPC's transport
    CPU per MB, plaintext or TLS (benchmarks/ingest.py). Within what HTTP/2 allows (RFC 9113 4.2).
    """
    return min(max(piece, 1 << 14), (1 << 24) - 1)


def client_channel(address: str, security: Security, options: list[tuple[str, Any]]) -> grpc.Channel:
    if security.tls:
        cert, key, ca = security.tls.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _TokenMetadata(security.token)) if security.token else channel


# -- the server's side -------------------------------------------------------------------------


def add_port(server: grpc.Server, address: str, security: Security) -> int:
    if security.tls:
        cert, key, ca = security.tls.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        return server.add_secure_port(address, creds)
    return server.add_insecure_port(address)


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

    def __init__(self, security: Security, on_refused: Callable[[str, str], None] | None = None):
        self.security = security
        self.on_refused = on_refused or (lambda method, why: None)
        self._subjects: dict[bytes, tuple[str, str]] = {}

    def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        method = details.method.rsplit("/", 1)[-1]
        if self.security.mode == "token":
            sent = dict(details.invocation_metadata or ()).get("authorization", "")
            handler = continuation(details)
            expected = f"Bearer {self.security.token}".encode()
            if handler is None or hmac.compare_digest(sent.encode(), expected):
                return handler
            # Whether a token came says nothing of the right one; the comparison stays constant-time.
            missing = not sent.removeprefix("Bearer").strip()
            self.on_refused(method, "no token" if missing else "a wrong token")
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSALS[missing])
        handler = continuation(details)
        if self.security.mode != "mtls" or handler is None:
            return handler
        return self._checked(handler, method)

    def _subject(self, context: grpc.ServicerContext) -> tuple[str, str]:
        pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
        if pem not in self._subjects:
            self._subjects[pem] = subject_of(pem) if pem else ("", "")
        return self._subjects[pem]

    def _deny(self, context: grpc.ServicerContext, method: str, why: str) -> None:
        self.on_refused(method, why)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _checked(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                role, name = self._subject(context)
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
            role, name = self._subject(context)
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


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
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
