"""Who may read the coordinator's HTTP side (the status page, its JSON, /metrics): the rule, as a
pure function, and what it needs (the access token, the TLS context).

    none   plaintext on loopback (or --insecure): open, as the gRPC side is
    token  the access token, as `Authorization: Bearer <token>` (Prometheus's `authorization` or
           `bearer_token_file`) or as the cookie a browser gets by opening `/?token=<token>`
    mtls   HTTPS with the coordinator's certificate; a verified client certificate whose role is
           observer or operator, or the access token as above

The access token is a random one, kept in `<workdir>/http_token` (0600) so a restarted
coordinator keeps the pages already logged in: the login link carries it, never the run's token
(a link is printed, kept in browser history and proxy logs; the run's token drives gRPC as any
worker). In token mode the run's token is taken too, as a bearer only (Prometheus, scripts).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from diloco import store
from diloco.plugins import a_or_an
from diloco.security.certs import TlsFiles
from diloco.security.revocation import RevocationList

# The certificate roles that may read the page and /metrics (as they may call Status).
READER_ROLES = ("observer", "operator")
TOKEN_FILE = "http_token"


class Access(NamedTuple):
    allowed: bool
    reason: str
    # A right `/?token=`: answer with the cookie and a redirect to `/`, not with the page.
    login: bool = False


def cookie_name(port: int) -> str:
    # Browsers share cookies across a host's ports: two coordinators on one host keep their own.
    return f"diloco_{port}"


def cookie_value(token: str) -> str:
    """What the cookie holds: derived from the token, so the browser's cookie store never keeps
    the token itself (nor a run token whose characters a cookie may not carry)."""
    return hmac.new(token.encode(), b"diloco status page", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.strip('"')
    return ""


def http_access(
    mode: str,
    target: str,
    *,
    authorization: str = "",
    cookie: str = "",
    cert_role: str = "",
    token: str = "",
    cookie_key: str = "diloco",
    bearer_also: Sequence[str] = (),
) -> Access:
    """May this request be answered? `target` is the request's path and query, `authorization`
    and `cookie` its headers, `cert_role` the role of its verified client certificate ("" when
    none), `token` the access token, `cookie_key` the cookie's name and `bearer_also` tokens
    taken as a bearer alone (the run's, in token mode: never in a link or a cookie)."""
    if mode == "none":
        return Access(True, "open: no TLS, no token")
    parts = urlsplit(target)
    given = parse_qs(parts.query).get("token")
    if parts.path == "/" and given:  # first: a right link always takes the token out of the address
        if _same(given[0], token):
            return Access(True, "the login link", login=True)
        return Access(False, "a wrong token in the link")
    if mode == "mtls" and cert_role in READER_ROLES:
        return Access(True, f"an {cert_role} certificate")
    scheme, _, sent = authorization.partition(" ")
    if scheme.lower() == "bearer":
        if any([_same(sent.strip(), t) for t in (token, *bearer_also)]):
            return Access(True, "the bearer token")
        return Access(False, "a wrong bearer token")
    if token and _same(_cookie(cookie, cookie_key), cookie_value(token)):
        return Access(True, "the login cookie")
    if mode == "mtls" and cert_role:
        return Access(False, f"{a_or_an(cert_role)} certificate may not read this page")
    return Access(False, "no credentials: the login link, a bearer token or an observer certificate")


def access_token(mode: str, workdir: str | Path | None) -> str:
    """The token that opens the HTTP side with TLS or a run token: a random one, kept in
    <workdir>/http_token (0600) when there is a workdir; none in plaintext without a token."""
    if mode not in ("mtls", "token"):
        return ""
    if workdir is None:
        return secrets.token_urlsafe(24)
    path = Path(workdir) / TOKEN_FILE
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if len(kept) >= 16:
        return kept
    made = secrets.token_urlsafe(24)
    store.write_bytes_atomic(str(path), (made + "\n").encode(), mode=0o600)
    return made


def server_context(tls: TlsFiles) -> ssl.SSLContext:
    """HTTPS with the coordinator's own certificate; a client certificate is optional (a browser
    has none) but, when sent, must be signed by the run's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    context.load_verify_locations(cafile=tls.ca)
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


def role_of(peer: dict | None, revocations: RevocationList | None = None) -> str:
    """The organizational unit (our certificates' role) of a verified peer certificate; none for
    a certificate revoked since it was issued (--tls-crl)."""
    serial = (peer or {}).get("serialNumber")
    if serial and revocations is not None and revocations.revoked(int(serial, 16), time.monotonic()):
        return ""
    for rdn in (peer or {}).get("subject", ()):
        for key, value in rdn:
            if key == "organizationalUnitName":
                return str(value)
    return ""
