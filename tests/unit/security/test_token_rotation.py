"""Rotating the run's token during a run: each process that took it from a --token-file reads the
file again when it changes; the coordinator takes the new token at once and the one before it for
a grace period (the hosts' files are not all replaced in the same second), then refuses it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.errors import DilocoError
from diloco.observe.worker_metrics import serve_worker_metrics
from diloco.security.tokens import TokenSource
from diloco.security.transport import Security, check_token, token_grace_s
from diloco.security.watched import RECHECK_S
from diloco.v1 import coordinator_pb2 as pb
from tests.unit.observe.test_http_access import fetch, observe_server

OLD, NEW = "old-token-of-the-run-0001", "new-token-of-the-run-0002"


def write(path: Path, token: str) -> None:
    """Replace the file whole, as an operator's `mv` or a mounted secret's update does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(token + "\n")
    tmp.replace(path)


def test_a_rotated_file_is_sent_at_once_and_the_old_token_taken_for_the_grace_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    write(path, OLD)
    tokens = TokenSource(OLD, str(path), check_token, grace_s=60.0)
    now = 100.0
    assert tokens.current(now) == OLD and tokens.accepted(now) == (OLD,)
    write(path, NEW)
    assert tokens.current(now + RECHECK_S / 2) == OLD  # the file is looked at once a second
    assert tokens.current(now + RECHECK_S) == NEW
    assert tokens.accepted(now + 30) == (NEW, OLD)
    assert tokens.accepted(now + RECHECK_S + 60) == (NEW,)
    # A version a token may not be (too short to be one: a file cut short) keeps the last, said once.
    caplog.set_level(logging.ERROR, logger="diloco.security")
    write(path, "short")
    for i in range(2, 5):
        assert tokens.current(now + 100 + i * RECHECK_S) == NEW
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "at least 16 characters" in said[0], said
    # A token given as such (DILOCO_TOKEN, or in code) is what it was.
    assert TokenSource(OLD).accepted(now) == (OLD,)


def test_the_grace_period_is_bounded() -> None:
    assert token_grace_s("") == 300.0 and token_grace_s("0") == 0.0
    for wrong in ("-1", "soon", "1e9"):
        with pytest.raises(DilocoError, match="DILOCO_TOKEN_GRACE_S"):
            token_grace_s(wrong)


def test_the_status_pages_bearer_follows_a_rotation(tmp_path: Path) -> None:
    """The coordinator's page takes the run's token as a bearer: the token file's latest, and the
    one before it for the grace, then not."""
    path = tmp_path / "token"
    write(path, OLD)
    grace = 1.0
    security = Security(token=OLD, token_file=str(path), token_grace_s=grace)
    server = observe_server(security, "page-access-token-0000", [])
    url = f"{server.url}api/status"
    try:
        assert fetch(url, Authorization=f"Bearer {OLD}")[0] == 200
        write(path, NEW)
        time.sleep(RECHECK_S * 1.2)
        rotated_by = time.monotonic()
        assert fetch(url, Authorization=f"Bearer {NEW}")[0] == 200  # the new token, at once
        assert fetch(url, Authorization=f"Bearer {OLD}")[0] == 200  # the old, within the grace
        time.sleep(max(0.0, rotated_by + grace + 0.2 - time.monotonic()))
        assert fetch(url, Authorization=f"Bearer {OLD}")[0] == 401  # and not after it
        assert fetch(url, Authorization=f"Bearer {NEW}")[0] == 200
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_coordinator_takes_a_rotated_token_and_shuts_the_old_one_out_after_its_grace(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    theirs, mine = tmp_path / "coordinator.token", tmp_path / "learner.token"
    for path in (theirs, mine):
        write(path, OLD)
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    grace = 3.0
    running = start_coordinator(
        cfg, str(tmp_path / "run"), security=Security(token=OLD, token_file=str(theirs), token_grace_s=grace)
    )
    address = f"127.0.0.1:{running.port}"
    learner = CoordinatorClient(
        address, pb.ROLE_COMPUTE, retry_deadline_s=2, security=Security(token=OLD, token_file=str(mine))
    )
    stale = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=2, security=Security(token=OLD))
    fresh = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=2, security=Security(token=NEW))
    try:
        learner.join()
        write(theirs, NEW)  # the coordinator's host first
        time.sleep(RECHECK_S * 1.5)
        rotated_at = time.monotonic()
        assert fresh.status()["security"] == "token"  # the new token, at once
        learner.heartbeat(pb.HeartbeatRequest(worker_id=learner.worker_id))  # the old, within the grace
        write(mine, NEW)  # then the learner's: its next calls carry the new token
        time.sleep(max(0.0, rotated_at + grace + RECHECK_S - time.monotonic()))
        learner.heartbeat(pb.HeartbeatRequest(worker_id=learner.worker_id))
        with pytest.raises(grpc.RpcError) as caught:  # the old token, after the grace: refused
            stale.status()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for client in (learner, stale, fresh):
            client.close()
        running.stop()


def test_a_workers_metrics_port_follows_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write(path, OLD)
    security = Security(token=OLD, token_file=str(path), token_grace_s=0.0)
    server = serve_worker_metrics("data", 0, "127.0.0.1", lambda: {"chunks_done": 1}, lambda: "d", security)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        assert fetch(url, Authorization=f"Bearer {OLD}")[0] == 200
        write(path, NEW)
        time.sleep(RECHECK_S * 1.2)
        assert fetch(url, Authorization=f"Bearer {NEW}")[0] == 200
        assert fetch(url, Authorization=f"Bearer {OLD}")[0] == 401  # no grace asked for: shut out
    finally:
        server.shutdown()
