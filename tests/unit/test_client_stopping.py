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
