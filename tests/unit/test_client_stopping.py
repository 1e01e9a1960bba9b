"""A worker that is stopping ends its background calls quietly: after leave() a coordinator that
answers "unknown worker" is not joined again, and a call after close() ends in ClientClosed, not in
grpc's ValueError (a prefetch thread that was between calls when its learner stopped logged that
one with a traceback)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from diloco.client import ClientClosed
from tests.support import tiny_coordinator


def test_a_client_that_left_is_not_joined_again_and_a_closed_one_says_so(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (_, learner, _init):
        assert learner.lease_shard().shard_id >= 0
        joined_as = learner.worker_id
        learner.leave("test")
        with pytest.raises(grpc.RpcError) as refused:
            learner.lease_shard()
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert learner.worker_id == joined_as and learner.stopping
        learner.close()
        with pytest.raises(ClientClosed):
            learner.lease_shard()


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Connection refused"


def test_an_outage_is_logged_once_per_call_and_its_end_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10-minute outage logged every retry was a hundred lines per worker thread."""
    import logging

    from diloco import client as client_module
    from diloco.client import CoordinatorClient
    from diloco.security.transport import Security
    from diloco.v1 import coordinator_pb2 as pb

    monkeypatch.setattr(client_module.time, "sleep", lambda _s: None)
    client = CoordinatorClient("127.0.0.1:9", pb.ROLE_DATA, security=Security())
    failures = iter(range(6))

    def flaky() -> str:
        if next(failures, None) is not None:
            raise Unavailable()
        return "answered"

    try:
        with caplog.at_level(logging.INFO, logger="diloco.client"):
            assert client._retry(flaky, "lease_chunk", retry_for_s=60) == "answered"
    finally:
        client.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2, lines
    assert "lease_chunk failed (UNAVAILABLE); retrying for up to 60s" in lines[0]
    assert "lease_chunk answered after" in lines[1] and "(6 retries)" in lines[1]
