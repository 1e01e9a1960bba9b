"""Regression tests for the attacks of issue 14 that need no identity to stop, each against a real
coordinator: what used to be accepted (and poisoned the run for good) is refused with its reason,
and changes nothing."""

from __future__ import annotations

import math
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from diloco import store
from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator import limits
from diloco.coordinator.server import start_coordinator
from diloco.data.shard import ShardInfo, write_shard
from diloco.v1 import coordinator_pb2 as pb
from tests.support import delta_header, stalled_push, tiny_coordinator


def refused(call) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    return caught.value.details()


def params_of(running) -> dict[str, torch.Tensor]:
    return {n: t.clone() for f in running.service.fragments for n, t in f.params.items()}


def wait_until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_huge_delta_cannot_throw_the_model_away(tiny_corpus: Path, tmp_path: Path) -> None:
    overrides = {"sync.max_staleness": 100, "data.epochs": 4}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        # Tokens no batch could hold (the weight tokens²/steps once overflowed the fp32 sums):
        header = delta_header(learner, "fp32", "huge-tokens")
        header.tokens = 1 << 60
        details = refused(lambda: learner.push(header, {n: torch.full_like(t, 1e3) for n, t in init.items()}))
        assert "tokens" in details
        # Honest deltas make the fragment's history; then one 10^4 times as large is an outlier.
        for i in range(5):
            honest = delta_header(learner, "fp32", f"honest-{i}")
            honest.version = running.service.fragments[0].version
            assert learner.push(honest, {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}).accepted
            wait_until(lambda i=i: running.service.fragments[0].version >= i + 1, "an honest merge")
        before = params_of(running)
        header = delta_header(learner, "fp32", "huge-values")
        header.version = running.service.fragments[0].version
        reply = learner.push(header, {n: torch.randn_like(t) * 10.0 for n, t in init.items()})
        assert not reply.accepted and "median" in reply.reason, reply
        assert running.ledger.push_state("huge-values")["state"] == "dropped"
        time.sleep(0.5)
        after = params_of(running)
        assert all(torch.equal(before[n], after[n]) for n in before), "a refused push changed the model"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outer_lr", [1e38, 1e39])  # overflows to inf; fails to convert (it raised)
def test_a_merge_that_is_not_finite_is_refused_and_changes_nothing(
    tiny_corpus: Path, tmp_path: Path, outer_lr: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The merge's own guard, for a delta the push's bound against the parameters would refuse.
    monkeypatch.setattr(limits, "MAX_DELTA_TO_PARAMS", 1e3)
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, learner, init):
        before = params_of(running)
        running.service.policy.outer_lr = outer_lr  # a merge of finite deltas that overflows fp32
        running.service.policy.outer_warmup_rounds = 0  # (a warm-up's first merge would average)
        header = delta_header(learner, "fp32", "overflows")
        assert learner.push(header, {n: torch.full_like(t, 10.0) for n, t in init.items()}).accepted
        wait_until(lambda: running.ledger.push_state("overflows")["state"] != "pending", "the round to close")
        state = running.ledger.push_state("overflows")
        assert state["state"] == "dropped" and "the round was refused" in state["reason"], dict(state)
        assert running.service.fragments[0].version == 0
        after = params_of(running)
        assert all(torch.equal(before[n], after[n]) for n in before)
        # The fragment is not wedged: the next honest round merges.
        running.service.policy.outer_lr = 0.7
        honest = delta_header(learner, "fp32", "honest")
        assert learner.push(honest, {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}).accepted
        wait_until(lambda: running.service.fragments[0].version == 1, "the honest merge")


@pytest.mark.timeout(120)
def test_shards_outside_the_store_and_impossible_counts_are_refused(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"data.epochs": 2}) as (running, learner, _):
        data = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_DATA)
        data.join()
        try:
            root = running.service.shard_root
            escape = pb.CompleteChunkRequest(
                chunk_id=1, completion_id="x", shard_uri=f"{root}/../../../../etc/passwd", rows=1, tokens=129
            )
            assert "outside the shard store" in refused(lambda: data.complete_chunk(escape))
            huge = pb.CompleteChunkRequest(
                chunk_id=1, completion_id="y", shard_uri=f"{root}/1.shard", rows=1, tokens=1 << 62
            )
            assert "2^50" in refused(lambda: data.complete_chunk(huge))
            status = learner.status()  # still answers: no sum overflowed
            assert status["tokens_prepared"] < limits.MAX_COUNT
        finally:
            data.close()


@pytest.mark.timeout(120)
def test_a_completed_shard_is_checked_against_its_file_before_it_becomes_ready(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """A data worker's report of a shard (rows, tokens, checksum, bytes) must be what its file
    holds: a lie, or a file changed after it was written, fails that attempt of the chunk (the
    chunk goes back to the pool) and no learner is ever handed the shard."""
    cfg = RunConfig().with_overrides(
        {"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "coordinator.max_chunk_attempts": 10}
    )
    running = start_coordinator(cfg, str(tmp_path / "run"))
    data = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_DATA)
    try:
        data.join()
        rows = np.arange(4 * 129, dtype=np.int64).reshape(4, 129) % 200

        def leased_and_written() -> tuple[pb.LeaseChunkReply, ShardInfo]:
            lease = data.lease_chunk()
            assert lease.shard_uri, lease
            info = write_shard(
                lease.shard_uri, rows, tokenizer_id="t", vocab_size=256, chunk_index=lease.chunk_id
            )
            return lease, info

        def complete(lease: pb.LeaseChunkReply, info: ShardInfo, **said: object) -> pb.CompleteChunkReply:
            report = {"rows": info.rows, "tokens": info.tokens, "checksum": info.checksum,
                      "shard_bytes": info.nbytes, **said}  # fmt: skip
            return data.complete_chunk(
                pb.CompleteChunkRequest(
                    chunk_id=lease.chunk_id, completion_id=uuid.uuid4().hex, shard_uri=info.uri, **report
                )
            )

        lies = [
            ({"rows": 5, "tokens": 5 * 129}, "rows 4 in the file, 5 in the completion"),
            ({"checksum": "sha256:" + "0" * 64}, "checksum"),
            ({"shard_bytes": 10}, "bytes in the file, 10 reported"),
        ]
        for said, words in lies:
            lease, info = leased_and_written()
            reply = complete(lease, info, **said)
            assert not reply.accepted and words in reply.reason, reply
            chunk = running.ledger._q("SELECT state, error FROM chunks WHERE id = ?", (lease.chunk_id,))[0]
            assert chunk["state"] == "pending" and chunk["error"].startswith("shard refused"), dict(chunk)
        # Bytes changed after the checksum was taken (a bad disk, or someone else's hand):
        lease, info = leased_and_written()
        path = Path(info.uri)
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF
        path.write_bytes(bytes(raw))
        reply = complete(lease, info)
        assert not reply.accepted and "hashes to" in reply.reason, reply
        assert running.ledger.counter("tokens_prepared") == 0 and not running.ledger._q(
            "SELECT id FROM shards"
        )
        # The honest report of an unchanged file is taken.
        lease, info = leased_and_written()
        assert complete(lease, info).accepted
        (shard,) = running.ledger._q("SELECT uri, rows, state FROM shards")
        assert (shard["uri"], shard["rows"], shard["state"]) == (info.uri, 4, "ready")
    finally:
        data.close()
        running.stop()


@pytest.mark.timeout(120)
def test_oversized_ids_and_impossible_counters_are_refused(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, learner, _):
        address = f"127.0.0.1:{running.port}"
        giant = CoordinatorClient(address, pb.ROLE_COMPUTE, worker_id="w" * (3 << 20))
        try:
            assert "longer than" in refused(lambda: giant.join(10))
        finally:
            giant.close()
        for bad in (
            pb.HeartbeatRequest(inner_steps=(1 << 64) - 1),
            pb.HeartbeatRequest(busy_seconds=math.inf),
            pb.HeartbeatRequest(last_loss=math.nan),
        ):
            assert "bad heartbeat" in refused(lambda bad=bad: learner.heartbeat(bad))
        assert learner.status()["workers"]  # Status still fits and answers


def test_uris_are_normalized_before_the_root_check() -> None:
    assert store.uri_under("/r/shards/1.shard", "/r/shards")
    assert store.uri_under("s3://b/run/shards/a/1.shard", "s3://b/run/shards/")
    assert not store.uri_under("/r/shards/../state/ledger.sqlite", "/r/shards")
    assert not store.uri_under("/r/shards", "/r/shards")
    assert not store.uri_under("/r/shardsX/1", "/r/shards")
    assert not store.uri_under("file:///r/shards/1", "/r/shards")
    assert not store.uri_under("/r/shards//1", "/r/shards")  # not in normal form


def test_push_claims_are_bounded_by_what_its_steps_can_hold() -> None:
    from diloco.config import RunConfig

    cfg = RunConfig()  # H 50, batch 16, rows of 129 tokens
    ok = pb.TensorHeader(inner_steps=50, tokens=50 * 16 * 129)
    assert limits.push_problem(ok, cfg) == ""
    assert "tokens" in limits.push_problem(pb.TensorHeader(inner_steps=50, tokens=50 * 16 * 129 + 1), cfg)
    assert "inner_steps" in limits.push_problem(pb.TensorHeader(inner_steps=0, tokens=1), cfg)
    assert "inner_steps" in limits.push_problem(pb.TensorHeader(inner_steps=10**9, tokens=1), cfg)
    assert "mean_loss" in limits.push_problem(
        pb.TensorHeader(inner_steps=1, tokens=1, mean_loss=math.inf), cfg
    )


@pytest.mark.timeout(120)
def test_a_blob_larger_than_its_shape_allows_is_refused_before_it_streams(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"sync.codec": "int8"}) as (running, learner, init):
        header = delta_header(learner, "int8", "big-blob")
        header.worker_id = learner.worker_id
        for name in running.service.fragments[0].names:  # 1.9 GiB declared, nothing sent after
            header.tensors.add(name=name, dtype="uint8", shape=[19 << 27])
        details = refused(
            lambda: learner.stub.PushDelta(iter([pb.TensorStreamMessage(header=header)]), timeout=20)
        )
        assert "at most for its shape" in details, details
        assert (
            running.ledger.push_state("big-blob") is None
            or running.ledger.push_state("big-blob")["state"] != "merged"
        )


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 100_003])
def test_every_real_blob_fits_the_bound_of_its_shape(codec: str, numel: int) -> None:
    from diloco.wire import codecs

    for values in (torch.randn(numel), torch.zeros(numel), torch.rand(numel) * 1e30):
        assert len(codecs.encode(values, codec)) <= codecs.max_blob_bytes(codec, numel)


@pytest.mark.timeout(120)
def test_joins_beyond_the_cap_of_live_workers_are_refused(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"coordinator.max_workers_per_role": 2}) as (
        running,
        first,
        _,
    ):
        address = f"127.0.0.1:{running.port}"
        second = CoordinatorClient(address, pb.ROLE_COMPUTE, worker_id="learner-two")
        third = CoordinatorClient(address, pb.ROLE_COMPUTE, worker_id="learner-three")
        try:
            second.join()
            request = pb.JoinRequest(role=pb.ROLE_COMPUTE, host="h", worker_id="learner-three")
            with pytest.raises(grpc.RpcError) as caught:
                third.stub.Join(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_workers_per_role" in caught.value.details()
            second.join()  # one already in may join again (a retry, a restart under its id)
            # Other roles have their own cap.
            data = CoordinatorClient(address, pb.ROLE_DATA, worker_id="data-x")
            data.join()
            data.close()
        finally:
            second.close()
            third.close()


@pytest.mark.timeout(120)
def test_a_push_that_sends_its_header_and_stalls_gives_its_slot_back(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    overrides = {"coordinator.max_inflight_pushes": 1, "coordinator.push_idle_s": 2.0}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        release = threading.Event()
        header_then_nothing = stalled_push(learner, init, release)  # holds the only slot

        outcome: list[tuple[grpc.StatusCode, str]] = []

        def push_and_stall() -> None:
            try:
                learner.stub.PushDelta(header_then_nothing(), timeout=30)
            except grpc.RpcError as e:
                outcome.append((e.code(), e.details()))

        thread = threading.Thread(target=push_and_stall)
        thread.start()
        try:
            time.sleep(0.3)
            honest = delta_header(learner, "fp32", "honest")
            deltas = {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}
            with pytest.raises(grpc.RpcError) as waited:  # the stalled push holds the only slot...
                learner.push(honest, deltas, timeout_s=0.5, retry_for_s=0)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, waited.value
            # ...until it has been silent for push_idle_s: then it is cancelled and the slot is free.
            assert learner.push(honest, deltas).accepted
            thread.join(10)
            assert [code for code, _ in outcome] == [grpc.StatusCode.CANCELLED], outcome
        finally:
            release.set()
            thread.join(10)
