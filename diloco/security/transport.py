"""How roles reach the coordinator safely: mutual TLS, or a shared token, or (on loopback) neither.

    mtls   every connection is TLS and carries a client certificate signed by the run's CA; the
           coordinator takes the caller's role and name from it (diloco.security.certs): a
           learner's certificate cannot lease chunks, nor heartbeat for another learner
    token  every call carries `authorization: Bearer <token>`, compared in constant time; the
           token's holders are trusted alike (a small set-up's shortcut)
    none   plaintext, no identity: refused beyond loopback unless --insecure says so

A role's settings come from its flags (`--tls-cert/--tls-key/--tls-ca`, `--token-file`,
`--insecure`), which the CLI puts in the environment (DILOCO_TLS_CERT, DILOCO_TLS_KEY,
DILOCO_TLS_CA, DILOCO_TOKEN_FILE, DILOCO_INSECURE), where every client of the process finds them.
A coordinator's `--tls-crl` (DILOCO_TLS_CRL) names the certificates revoked since they were
issued (diloco.security.revocation).
DILOCO_TOKEN gives the token itself: checked and stripped as a file's is, and refused beside a
token file (which of the two was meant is not ours to guess).
"""

from __future__ import annotations

import collections
import datetime
import functools
import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from diloco.clock import lasting
from diloco.errors import DilocoError
from diloco.security.certs import (
    TlsFiles,
    ca_dates_problem,
    certificate_problem,
    dates_problem,
    key_problem,
    serving_problem,
    subject_of,
)
from diloco.security.revocation import RevocationList
from diloco.security.tokens import ROTATION_GRACE_S, TokenSource

ENV = {"cert": "DILOCO_TLS_CERT", "key": "DILOCO_TLS_KEY", "ca": "DILOCO_TLS_CA"}
TOKEN_ENV, TOKEN_FILE_ENV, INSECURE_ENV = "DILOCO_TOKEN", "DILOCO_TOKEN_FILE", "DILOCO_INSECURE"
CRL_ENV, TOKEN_GRACE_ENV = "DILOCO_TLS_CRL", "DILOCO_TOKEN_GRACE_S"


@dataclass(frozen=True)
class Security:
    tls: TlsFiles | None = None
    token: str = ""
    insecure: bool = False
    crl: str = ""  # a server's certificate revocation list (mutual TLS only)
    token_file: str = ""  # where `token` was read: read again when it changes (a rotation)
    token_grace_s: float = ROTATION_GRACE_S  # a server takes the token before a rotation this long

    @functools.cached_property
    def tokens(self) -> TokenSource:
        """The token to send and the tokens to take, now: `token`, or the token file's latest."""
        return TokenSource(self.token, self.token_file, check_token, self.token_grace_s)

    @functools.cached_property
    def revocations(self) -> RevocationList | None:
        """The revoked certificates a server checks every call against (read once here, and
        again when the file changes); None without --tls-crl."""
        if not (self.tls and self.crl):
            return None
        return RevocationList(self.crl, self.tls.read()[2])

    @property
    def mode(self) -> str:
        return "mtls" if self.tls else "token" if self.token else "none"

    @classmethod
    def from_env(cls) -> Security:
        paths = {k: os.environ.get(v, "") for k, v in ENV.items()}
        if any(paths.values()) and not all(paths.values()):
            raise DilocoError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        token_file = os.environ.get(TOKEN_FILE_ENV, "")
        token = token_from(os.environ.get(TOKEN_ENV, ""), token_file)
        crl = os.environ.get(CRL_ENV, "")
        if crl and not all(paths.values()):
            raise DilocoError(
                "--tls-crl revokes certificates: it needs mutual TLS (--tls-cert/--tls-key/--tls-ca)"
            )
        return cls(
            TlsFiles(**paths) if all(paths.values()) else None,
            token,
            os.environ.get(INSECURE_ENV) == "1",
            crl,
            token_file,
            token_grace_s(os.environ.get(TOKEN_GRACE_ENV, "")),
        )

    def name(self) -> str | None:
        """The name in this role's certificate (its worker id), if it has one."""
        if not self.tls:
            return None
        cert, _, _ = self.tls.read()
        if problem := certificate_problem(cert):
            raise DilocoError(
                f"--tls-cert {self.tls.cert} {problem}: give the .crt `diloco certs issue` wrote"
            )
        return subject_of(cert)[1]


def token_grace_s(value: str) -> float:
    """DILOCO_TOKEN_GRACE_S: how long a coordinator still takes the token before a rotation."""
    if not value:
        return ROTATION_GRACE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 86400:
        raise DilocoError(f"{TOKEN_GRACE_ENV}={value!r}: give seconds from 0 to 86400")
    return seconds


def token_from(value: str, path: str) -> str:
    """The run's token from DILOCO_TOKEN's `value` or the token file at `path` ("" for neither).
    Both given: refused, since either could be the one meant (an exported variable left over, or
    the flag just typed); the error names both."""
    if value and path:
        raise DilocoError(
            f"both {TOKEN_ENV} and --token-file ({TOKEN_FILE_ENV}={path}) give a token: "
            f"unset {TOKEN_ENV} or drop --token-file"
        )
    if path:
        return read_token(path)
    return check_token(value, TOKEN_ENV) if value else ""


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text()
    except OSError as e:
        raise DilocoError(f"cannot read the token file: {e}") from e
    return check_token(token, path)


def check_token(token: str, source: str) -> str:
    """`token` without the whitespace around it (a file's newline, a pasted space), refused when
    short enough to guess or when it cannot travel as a header value: the same from a file or
    from the environment."""
    token = token.strip()
    if len(token) < 16:
        raise DilocoError(f"{source}: a token must be at least 16 characters")
    if not (token.isascii() and token.isprintable()):
        raise DilocoError(f"{source}: a token must be printable ASCII on one line")
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
    returns a warning to print when --insecure allows it anyway, or when a token guards it: the
    token travels unencrypted, so whoever sees the traffic holds it too."""
    if security.mode == "mtls" or is_loopback(host):
        return ""
    if security.mode == "token":
        return (
            f"serving on {host} with a token but without TLS: a token is sent in cleartext on every "
            "call: anyone on the network path can read it; use mutual TLS beyond a trusted network"
        )
    if not security.insecure:
        raise DilocoError(
            f"listening on {host} without TLS or a token lets anyone who reaches the port drive the run: "
            "give --tls-cert/--tls-key/--tls-ca (diloco certs) or --token-file, or --insecure to accept it"
        )
    return (
        f"serving on {host} without TLS or a token (--insecure): anyone who reaches the port drives the run"
    )


def tls_problem(tls: TlsFiles, now: datetime.datetime) -> str:
    """What is wrong with a role's three TLS files, naming the flag to fix ("" when nothing):
    gRPC itself says only "Failed to create security handshaker" (a client, after its whole
    connect timeout) or fails to bind (the coordinator, blamed on the port)."""
    cert, key, ca = tls.read()
    if problem := certificate_problem(cert):
        return f"--tls-cert {tls.cert} {problem}: give the .crt `diloco certs issue` wrote"
    if problem := key_problem(cert, key):
        return f"--tls-key {tls.key} {problem} (--tls-cert {tls.cert}): give the .key issued with it"
    if problem := certificate_problem(ca, bundle=True):
        return f"--tls-ca {tls.ca} {problem}: give the run's CA certificate (ca.crt of `diloco certs init`)"
    if problem := ca_dates_problem(ca, now):
        return (
            f"--tls-ca {tls.ca} {problem}: make a new CA (`diloco certs init`) and issue every role's "
            "certificate from it"
        )
    return ""


def expiry_problem(tls: TlsFiles, now: datetime.datetime, whose: str) -> str:
    """Why `whose` certificate is out of date, with the command that issues a new one ("" when in
    date): its peers would refuse it, and say only that they do not trust it."""
    cert = Path(tls.cert).read_bytes()
    if not (problem := dates_problem(cert, now)):
        return ""
    role, name = subject_of(cert)
    hosts = " --host <its address>" if role == "coordinator" else ""
    return (
        f"{whose} ({tls.cert}: {role or 'no role'} {name}) {problem}: issue a new one with diloco certs "
        f"issue --out {Path(tls.ca).parent} --role {role or '<role>'} --name {name or '<name>'}{hosts}"
    )


def check_serving(security: Security, now: datetime.datetime | None = None) -> None:
    """Refuse, at start and before anything is written, TLS files the coordinator cannot serve
    with: a key not the certificate's, a CA file that is no certificate, an expired certificate,
    a certificate clients would refuse from a server (a learner's, say). Otherwise gRPC fails to
    bind (blamed on the port) or the coordinator listens and every client fails its handshake."""
    if not security.tls:
        return
    now = now or datetime.datetime.now(datetime.UTC)
    if problem := tls_problem(security.tls, now) or expiry_problem(security.tls, now, "--tls-cert"):
        raise DilocoError(problem)
    cert, _, _ = security.tls.read()
    security.revocations  # noqa: B018 (read now: a list that is unreadable or not the CA's is refused at start)
    if problem := serving_problem(cert):
        ca_dir = Path(security.tls.ca).parent
        raise DilocoError(
            f"--tls-cert {security.tls.cert} {problem}; give the coordinator its own: "
            f"diloco certs issue --out {ca_dir} --role coordinator --name coordinator --host <its address>"
        )


def check_client(security: Security, now: datetime.datetime | None = None) -> None:
    """Refuse, before connecting, TLS files no handshake can succeed with: otherwise a key not
    the certificate's waits out the connect timeout ("Failed to create security handshaker"), and
    an expired certificate is refused by the coordinator as if another CA had issued it."""
    if not security.tls:
        return
    now = now or datetime.datetime.now(datetime.UTC)
    if problem := tls_problem(security.tls, now) or expiry_problem(security.tls, now, "your certificate"):
        raise DilocoError(problem)


# -- the client's side -------------------------------------------------------------------------

# How long a connection must keep failing its handshake before a client stops waiting: a
# coordinator killed mid-handshake fails one attempt, never every attempt for seconds (gRPC
# retries after 1 s, then 1.6 s, ...), while a client whose security does not match the
# coordinator's would wait out its whole connect timeout and learn only "cannot reach".
HANDSHAKE_PATIENCE_S = 2.5


def handshake_problem(last_error: str, security: Security, address: str = "") -> str:
    """What gRPC's last connection error says about the two ends' security ("" when it is not a
    handshake's failure: a coordinator that is down refuses the TCP connection instead).
    `address`, the HOST:PORT dialled, names the host a coordinator's certificate must name."""
    if "Hostname Verification Check failed" in last_error:
        return hostname_problem(address, security)
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


def hostname_problem(address: str, security: Security) -> str:
    """The coordinator's certificate does not name the host dialled (it was issued for another
    address, or without --host): a certificate, not a network, problem, so no wait cures it."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else ""
    out = Path(security.tls.ca).parent if security.tls else "<the CA's directory>"
    return (
        f"the coordinator's certificate does not name the address you dial{f' ({host})' if host else ''}: "
        f"re-issue it with `diloco certs issue --out {out} --role coordinator --name <its name> "
        f"--host {host or '<that address>'}` and restart it, or dial an address it names"
    )


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
    """Adds the token to every call's metadata: the token file's latest (a rotation)."""

    def __init__(self, tokens: TokenSource):
        self.tokens = tokens

    def _details(self, d: Any) -> _CallDetails:
        header = ("authorization", f"Bearer {self.tokens.current(time.monotonic())}")
        metadata = [*(d.metadata or []), header]
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
        check_client(security)  # every client role is built here: its files are checked once, now
        cert, key, ca = security.tls.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _TokenMetadata(security.tokens)) if security.token else channel


# -- the server's side -------------------------------------------------------------------------


def add_port(server: grpc.Server, address: str, security: Security) -> int:
    if security.tls:
        cert, key, ca = security.tls.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        return server.add_secure_port(address, creds)
    return server.add_insecure_port(address)
