"""Who may read the status page and /metrics: the rule alone (every case), then real servers on
loopback, one in token mode (plain HTTP) and one under mTLS (HTTPS, certificates from the run's
CA), read with urllib as a browser or Prometheus would."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.errors import DilocoError
from diloco.observe.access import Access, access_token, cookie_value, http_access
from diloco.observe.events import RunEvents
from diloco.observe.http import ObserveServer
from diloco.observe.prometheus import CoordinatorMetrics
from diloco.observe.worker_metrics import serve_worker_metrics
from diloco.security.certs import TlsFiles, init_ca, issue
from diloco.security.transport import Security
from tests.unit.observe.test_prometheus import DETAIL

TOKEN = "a-token-of-the-run-0123456789"
PAGE_TOKEN = "the-page-s-own-0123456789"  # access_token's: the login link never carries the run's
COOKIE = f"diloco_8080={cookie_value(TOKEN)}"


def rule(mode: str, target: str = "/api/status", **kw: str) -> Access:
    return http_access(mode, target, token=TOKEN, cookie_key="diloco_8080", **kw)


# -- the rule ---------------------------------------------------------------------------------


def test_without_tls_or_token_the_page_is_open() -> None:
    assert rule("none").allowed
    assert rule("none", "/?token=wrong").allowed and not rule("none", "/?token=wrong").login


def test_token_mode_wants_the_token_as_a_bearer_or_a_cookie() -> None:
    assert not rule("token").allowed
    assert "no credentials" in rule("token").reason
    assert not rule("token", authorization="Bearer wrong").allowed
    assert not rule("token", authorization=f"Basic {TOKEN}").allowed
    assert rule("token", authorization=f"Bearer {TOKEN}").allowed
    assert rule("token", authorization=f"bearer {TOKEN}").allowed  # the scheme is case-blind
    assert rule("token", cookie=f"other=1; {COOKIE}").allowed
    assert not rule("token", cookie=f"diloco_8080={cookie_value('another token')}").allowed
    assert not rule("token", cookie=f"diloco_8081={cookie_value(TOKEN)}").allowed  # another port's
    assert not rule("token", cookie=f"diloco_8080={TOKEN}").allowed  # the cookie is not the token


def test_the_login_link_sets_the_cookie_only_with_the_right_token() -> None:
    login = rule("token", f"/?token={TOKEN}")
    assert login.allowed and login.login
    assert rule("token", f"/?token={TOKEN}", cookie=COOKIE).login  # logged in: still redirected
    assert not rule("token", "/?token=wrong").allowed
    assert not rule("token", f"/api/status?token={TOKEN}").allowed  # only the page's address logs in
    assert not rule("token", "/").allowed


def test_mtls_admits_observer_and_operator_certificates_or_the_token() -> None:
    assert rule("mtls", cert_role="observer").allowed
    assert rule("mtls", cert_role="operator").allowed
    learner = rule("mtls", cert_role="learner")
    assert not learner.allowed and "learner" in learner.reason
    assert not rule("mtls").allowed
    assert rule("mtls", cert_role="learner", authorization=f"Bearer {TOKEN}").allowed
    assert rule("mtls", cookie=COOKIE).allowed
    assert rule("mtls", f"/?token={TOKEN}").login
    assert not rule("token", cert_role="observer").allowed  # without TLS a role is nobody's word


def test_the_access_token_is_random_and_kept_0600_in_the_workdir(tmp_path: Path) -> None:
    """In token mode too: the login link carries a token of its own, never the run's (a red team
    read the run's token off a printed link: it drives gRPC as any worker)."""
    assert access_token("none", tmp_path) == ""
    made = access_token("mtls", tmp_path)
    assert len(made) >= 24 and access_token("mtls", tmp_path) == made  # a restart keeps it
    assert access_token("token", tmp_path) == made  # the same file, whatever the mode
    assert (tmp_path / "http_token").stat().st_mode & 0o777 == 0o600
    assert access_token("mtls", None) != access_token("mtls", None)
    assert access_token("token", None) not in ("", access_token("token", None))


def test_the_run_token_opens_as_a_bearer_only() -> None:
    page = "page-token-0123456789"
    assert http_access(
        "token", "/api/status", authorization=f"Bearer {TOKEN}", token=page, bearer_also=(TOKEN,)
    ).allowed
    assert not http_access("token", f"/?token={TOKEN}", token=page, bearer_also=(TOKEN,)).allowed
    assert not http_access(
        "token", "/", cookie=f"diloco={cookie_value(TOKEN)}", token=page, bearer_also=(TOKEN,)
    ).allowed
    assert http_access("token", f"/?token={page}", token=page, bearer_also=(TOKEN,)).login


# -- real servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    ca = tmp_path_factory.mktemp("ca")
    init_ca(ca)
    roles = {"coordinator": "coordinator", "watcher": "observer", "ops": "operator", "learner-0": "learner"}
    return {name: issue(ca, role, name) for name, role in roles.items()}


def observe_server(security: Security, token: str, refused: list[tuple[str, str]]) -> ObserveServer:
    return ObserveServer(
        "127.0.0.1",
        0,
        metrics=CoordinatorMetrics(lambda: DETAIL),
        detail=lambda: DETAIL,
        events=RunEvents(None, tensorboard=False),
        page=True,
        security=security,
        access_token=token,
        on_refused=lambda method, why, peer: refused.append((method, why)),
    )


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return None  # the 303 itself is what is checked


def fetch(url: str, context: ssl.SSLContext | None = None, **headers: str) -> tuple[int, dict, bytes]:
    opener = urllib.request.build_opener(NoRedirect(), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def token_server() -> Iterator[tuple[ObserveServer, list]]:
    refused: list[tuple[str, str]] = []
    server = observe_server(Security(token=TOKEN), PAGE_TOKEN, refused)
    yield server, refused
    server.stop()


def test_a_token_mode_server_answers_only_with_the_token(token_server) -> None:  # noqa: ANN001
    server, refused = token_server
    assert server.url.startswith("http://") and server.login_url == f"{server.url}?token={PAGE_TOKEN}"
    code, _, body = fetch(server.url + "api/status")
    assert code == 401 and body.count(b"\n") == 1 and refused == [("http /api/status", body.decode().strip())]
    assert fetch(server.url + "metrics", Authorization="Bearer wrong")[0] == 401
    code, _, body = fetch(server.url + "api/status", Authorization=f"Bearer {TOKEN}")
    assert code == 200 and json.loads(body)["run_state"] == "running"
    assert fetch(server.url + "nowhere")[0] == 404
    # A browser: the link sets the cookie and sends it to "/", where the cookie opens the page.
    code, headers, _ = fetch(server.login_url)
    assert code == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    assert TOKEN not in cookie
    code, headers, body = fetch(server.url, Cookie=cookie.split(";")[0])
    assert code == 200 and headers["Content-Type"].startswith("text/html") and b"<html" in body.lower()
    assert fetch(server.url + "api/history", Cookie=cookie.split(";")[0])[0] == 200
    assert fetch(server.url + "?token=wrong")[0] == 401
    assert fetch(server.url + f"?token={TOKEN}")[0] == 401  # the run's token logs no browser in
    assert fetch(server.url + "api/status", Authorization=f"Bearer {PAGE_TOKEN}")[0] == 200


def test_an_mtls_server_is_https_for_readers_certificates_or_the_token(
    certs: dict[str, TlsFiles],
) -> None:
    refused: list[tuple[str, str]] = []
    server = observe_server(Security(tls=certs["coordinator"]), "the-random-one-0123456789", refused)

    def client(name: str | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=certs["coordinator"].ca)
        if name:
            context.load_cert_chain(certs[name].cert, certs[name].key)
        return context

    try:
        status = server.url + "api/status"
        assert server.url.startswith("https://127.0.0.1:")
        assert fetch(status, client())[0] == 401
        assert fetch(status, client("learner-0"))[0] == 401
        assert fetch(status, client("watcher"))[0] == 200
        assert fetch(server.url + "metrics", client("ops"))[0] == 200
        bearer = {"Authorization": "Bearer the-random-one-0123456789"}
        assert fetch(server.url + "metrics", client(), **bearer)[0] == 200
        code, headers, _ = fetch(server.login_url, client())
        assert code == 303 and "; Secure" in headers["Set-Cookie"]
        assert fetch(server.url, client(), Cookie=headers["Set-Cookie"].split(";")[0])[0] == 200
        assert [m for m, _ in refused] == ["http /api/status", "http /api/status"]
        # Plain HTTP at the HTTPS port gets nowhere, nor does a client that does not know the CA.
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/api/status", timeout=10)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(status, timeout=10, context=ssl.create_default_context())
        assert fetch(status, client("watcher"))[0] == 200  # the server outlived them
    finally:
        server.stop()


def test_beyond_loopback_the_http_side_needs_tls_a_token_or_insecure() -> None:
    with pytest.raises(DilocoError, match="without TLS or a token"):
        ObserveServer(
            "0.0.0.0",
            0,
            metrics=CoordinatorMetrics(lambda: {}),
            detail=dict,
            events=RunEvents(None, tensorboard=False),
            page=False,
            security=Security(),
            access_token="",
        )


def test_a_workers_metrics_want_the_runs_token_in_token_mode() -> None:
    server = serve_worker_metrics(
        "data", 0, "127.0.0.1", lambda: {"chunks_done": 2}, lambda: "data-0", Security(token=TOKEN)
    )
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert fetch(url)[0] == 401
        code, _, body = fetch(url, Authorization=f"Bearer {TOKEN}")
        assert code == 200 and b"diloco_data_worker_chunks_done_total" in body
        # A bearer only (what Prometheus sends): the run's token opens it neither in the address
        # nor as a cookie.
        assert fetch(f"{url}?token={TOKEN}")[0] == 401
        assert fetch(url, Cookie=f"diloco_{server.server_port}={cookie_value(TOKEN)}")[0] == 401
    finally:
        server.shutdown()
    with pytest.raises(DilocoError, match="without TLS or a token"):
        serve_worker_metrics("data", 0, "0.0.0.0", dict, str, Security())
    # A worker's certificate does not make its plaintext port safe beyond loopback.
    tls = Security(tls=TlsFiles("c", "k", "ca"))
    with pytest.raises(DilocoError, match="without TLS or a token"):
        serve_worker_metrics("data", 0, "0.0.0.0", dict, str, tls)
