"""The data side against the red team's attacks 8-11 (walkR/redteam/REPORT.md): any learner sent any
shard (another's, the held-out ones) back to be made again; its error text forged log lines; any
data worker completed any chunk with a file of its choosing; and the coordinator read whatever file
a completion named, whole (a FIFO blocked a handler, a sparse 1 GiB file took 1 GiB), before any
check. The pure rules first (lease_claims, log_text), then the ledger with a moved clock, then each
attack against a real coordinator."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from diloco import store
from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator import lease_claims
from diloco.coordinator.lease_claims import ChunkRow, Refusal, ShardRow, completion_verdict, report_verdict
from diloco.coordinator.ledger import ChunkLease, Ledger, ShardLease
from diloco.coordinator.log_text import loggable
from diloco.coordinator.server import start_coordinator
from diloco.data.shard import ShardInfo, write_shard
from diloco.v1 import coordinator_pb2 as pb
from tests.support import FakeClock, tiny_coordinator
from tests.unit.coordinator.ledger_setup import make

DENIED = grpc.StatusCode.PERMISSION_DENIED


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def report(client: CoordinatorClient, shard_id: int, error: str = "x") -> pb.ReportShardReply:
    """A ReportShard sent once (the client retries RESOURCE_EXHAUSTED for a minute)."""
    request = pb.ReportShardRequest(worker_id=client.worker_id, shard_id=shard_id, error=error)
    return client.stub.ReportShard(request, timeout=10)


def complete_once(client: CoordinatorClient, request: pb.CompleteChunkRequest) -> pb.CompleteChunkReply:
    request.worker_id = client.worker_id
    return client.stub.CompleteChunk(request, timeout=10)


# -- the rules ---------------------------------------------------------------------------------


def test_caller_text_is_logged_cut_on_one_line() -> None:
    assert (
        loggable("bad\nFAKE LOG LINE\r\x1b[2J\u2028\u202e") == "bad\\nFAKE LOG LINE\\r\\x1b[2J\\u2028\\u202e"
    )
    assert loggable("ok: é 中 ✓") == "ok: é 中 ✓"
    assert len(loggable("A" * 3_000_000)) < 320


def test_a_shard_report_is_its_last_holders() -> None:
    def verdict(split="train", state="ready", holder=None, last="l1", held=True, recent=0):
        return report_verdict("l1", 7, ShardRow(split, state, holder, last, held, recent)).refusal

    assert verdict() is None  # given back (or lapsed), nobody leased it since
    assert verdict(state="leased", holder="l1") is None  # reported while still held
    assert verdict(held=False, last=None) is Refusal.DENIED  # never leased to it
    assert verdict(split="eval", held=False, last=None) is Refusal.DENIED  # the held-out split
    assert verdict(state="leased", holder="l2", last="l2") is Refusal.STALE  # another's now
    assert verdict(last="l2") is Refusal.STALE
    assert verdict(state="corrupt") is Refusal.STALE
    assert verdict(recent=lease_claims.MAX_SHARD_REPORTS) is Refusal.TOO_MANY


def test_a_completion_is_its_attempts_lease_holders() -> None:
    def verdict(
        worker="d1", attempt=1, state="leased", holder="d1", attempts=1, leased_to="d1", recorded=None
    ):
        uri = f"/s/chunk-000003-a{attempt}.shard"
        return completion_verdict(
            worker, 3, attempt, uri, ChunkRow(state, holder, attempts, leased_to, recorded)
        ).refusal

    assert verdict() is None
    assert verdict(leased_to=None) is None  # leased before attempts were recorded: its holder
    assert verdict(worker="d2", leased_to="d1") is Refusal.DENIED
    assert verdict(attempts=0, holder=None, state="pending", leased_to=None) is Refusal.DENIED
    assert verdict(state="pending", holder=None) is None  # lapsed, nobody took it since
    assert verdict(state="leased", holder="d2", attempts=2) is Refusal.STALE  # leased again
    assert verdict(state="pending", holder=None, attempts=2) is Refusal.STALE
    assert verdict(state="done", holder=None) is Refusal.STALE
    # Pending again because its shard was reported corrupt: that attempt's file is not taken again.
    assert verdict(state="pending", holder=None, recorded="/s/chunk-000003-a1.shard") is Refusal.STALE
    assert lease_claims.attempt_of("/s", 3, "/s/chunk-000003-a2.shard") == 2
    for uri in (
        "/s/chunk-000004-a2.shard",
        "/s/evil.shard",
        "/s/x/chunk-000003-a2.shard",
        "/s/chunk-000003-a0.shard",
    ):
        assert lease_claims.attempt_of("/s", 3, uri) is None, uri


# -- the ledger, its clock moved ---------------------------------------------------------------


def complete(ledger: Ledger, worker: str, chunk_id: int, attempt: int, cid: str):
    uri = f"/s/chunk-{chunk_id:06d}-a{attempt}.shard"
    return ledger.complete_chunk(worker, chunk_id, cid, uri, 10, 80, "sum", 1234, {}, attempt=attempt)


def test_a_lapsed_chunk_lease_is_its_holders_until_another_takes_it(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = Ledger(str(tmp_path / "l.sqlite"), clock=clock)
    try:
        make(ledger, ["train", "train"])
        a = ledger.lease_chunk("d1", 10.0)
        assert isinstance(a, ChunkLease)
        assert not complete(ledger, "d2", a.chunk_id, 1, "x").accepted  # not d2's attempt
        clock.advance(11)
        ledger.reclaim_expired(10.0)
        assert complete(ledger, "d1", a.chunk_id, 1, "late").accepted  # nobody took it since
        b = ledger.lease_chunk("d1", 10.0)
        clock.advance(11)
        again = ledger.lease_chunk("d2", 10.0)  # d1's lease lapsed and d2 took the chunk
        assert isinstance(again, ChunkLease) and (again.chunk_id, again.attempt) == (b.chunk_id, 2)
        late = complete(ledger, "d1", b.chunk_id, 1, "too-late")
        assert not late.accepted and "leased again" in late.reason
        assert not complete(ledger, "d1", b.chunk_id, 2, "not-mine").accepted
        assert complete(ledger, "d2", b.chunk_id, 2, "d2").accepted
        assert complete(ledger, "d2", b.chunk_id, 2, "d2").reason == "already recorded"  # a retry
    finally:
        ledger.close()


def test_shard_reports_are_bounded_per_learner_by_the_hour(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lease_claims, "MAX_SHARD_REPORTS", 1)
    clock = FakeClock()
    ledger = Ledger(str(tmp_path / "l.sqlite"), clock=clock)
    try:
        make(ledger, ["train", "train", "train"])
        for _ in range(3):
            lease = ledger.lease_chunk("d1", 10.0)
            assert complete(ledger, "d1", lease.chunk_id, 1, f"c{lease.chunk_id}").accepted
        first, second = ledger.lease_shard("L1", 1e6), ledger.lease_shard("L1", 1e6)
        assert isinstance(first, ShardLease) and isinstance(second, ShardLease)
        assert ledger.report_shard("L1", first.shard_id, "bad").taken
        assert ledger.report_shard("L1", second.shard_id, "bad").refusal is Refusal.TOO_MANY
        assert ledger.counter("shards_corrupt") == 1
        clock.advance(lease_claims.SHARD_REPORT_WINDOW_S + 1)
        assert ledger.report_shard("L1", second.shard_id, "bad").taken
    finally:
        ledger.close()


# -- against a real coordinator ----------------------------------------------------------------


def shard_state(running, shard_id: int) -> tuple:
    row = running.ledger._q(
        "SELECT s.state, s.holder, c.state FROM shards s JOIN chunks c ON c.id = s.chunk_id WHERE s.id = ?",
        (shard_id,),
    )[0]
    return tuple(row)


def lease_until(client: CoordinatorClient, shard_id: int) -> None:
    for _ in range(64):
        if client.lease_shard().shard_id == shard_id:
            return
    raise AssertionError(f"never leased shard {shard_id}")


@pytest.mark.timeout(120)
def test_a_learner_reports_only_a_train_shard_it_leased_last(
    tiny_corpus: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="diloco")
    with tiny_coordinator(tiny_corpus, tmp_path, {"data.epochs": 2}) as (running, l1, _):
        l2 = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        l2.join()
        try:
            held = l2.lease_shard().shard_id
            before = shard_state(running, held)
            assert before[:2] == ("leased", l2.worker_id)
            # Another learner's shard, the held-out shard, a shard that does not exist: refused.
            assert code_of(lambda: report(l1, held, "x"))[0] == DENIED
            eval_shard = running.ledger._q("SELECT id FROM shards WHERE split = 'eval'")[0][0]
            evals_before = shard_state(running, eval_shard)
            assert code_of(lambda: report(l1, eval_shard, "x"))[0] == DENIED
            assert code_of(lambda: report(l1, 10_000, "x"))[0] == DENIED
            assert shard_state(running, held) == before and shard_state(running, eval_shard) == evals_before
            # A learner whose lease went to another since: not taken, nothing changes.
            running.ledger.release_shards(l2.worker_id, [held])
            lease_until(l1, held)
            assert not report(l2, held, "x").reprocessing
            assert shard_state(running, held) == ("leased", l1.worker_id, "done")
            assert running.ledger.counter("shards_corrupt") == 0
            # Its last holder's report is taken; its text goes to the log on one line, cut.
            evil = "bad\nFAKE LOG LINE: coordinator compromised\x1b[2J" + "A" * 100_000
            assert report(l1, held, evil).reprocessing
            assert shard_state(running, held) == ("corrupt", None, "pending")
            # One report too many: refused, nothing changes.
            monkeypatch.setattr(lease_claims, "MAX_SHARD_REPORTS", 1)
            mine = running.ledger._q(
                "SELECT id FROM shards WHERE state = 'leased' AND holder = ?", (l1.worker_id,)
            )
            other = mine[0][0] if mine else l1.lease_shard().shard_id
            assert other
            code, why = code_of(lambda: report(l1, other, "x"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "at most" in why
            assert shard_state(running, other) == ("leased", l1.worker_id, "done")
            assert running.ledger.counter("shard_reports_refused") >= 5
        finally:
            l2.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("diloco")]
    assert any("reported corrupt" in line for line in lines)
    assert not any("\n" in line or "\x1b" in line or len(line) > 2000 for line in lines), [
        line[:200] for line in lines if "\n" in line or "\x1b" in line or len(line) > 2000
    ]


def data_run(tiny_corpus: Path, tmp_path: Path):
    cfg = RunConfig().with_overrides(
        {"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "coordinator.max_chunk_attempts": 10}
    )
    return start_coordinator(cfg, str(tmp_path / "run"))


def written(lease: pb.LeaseChunkReply, uri: str | None = None) -> ShardInfo:
    rows = np.arange(4 * 129, dtype=np.int64).reshape(4, 129) % 200
    return write_shard(
        uri or lease.shard_uri, rows, tokenizer_id="t", vocab_size=256, chunk_index=lease.chunk_id
    )


def completion(chunk_id: int, info: ShardInfo, uri: str | None = None, **said) -> pb.CompleteChunkRequest:
    fields = {
        "rows": info.rows,
        "tokens": info.tokens,
        "checksum": info.checksum,
        "shard_bytes": info.nbytes,
        **said,
    }
    return pb.CompleteChunkRequest(
        chunk_id=chunk_id, completion_id=uuid.uuid4().hex, shard_uri=uri or info.uri, **fields
    )


@pytest.mark.timeout(120)
def test_only_the_lease_holder_completes_a_chunk_with_its_attempts_file(
    tiny_corpus: Path, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="diloco")
    running = data_run(tiny_corpus, tmp_path)
    d1, d2 = (CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_DATA) for _ in range(2))
    try:
        d1.join(), d2.join()
        lease = d1.lease_chunk()
        info = written(lease)

        def chunk() -> tuple:
            return tuple(
                running.ledger._q("SELECT state, holder FROM chunks WHERE id = ?", (lease.chunk_id,))[0]
            )

        # d2 completes d1's chunk: with d1's file, with a copy of its own naming, with attempt 2's.
        assert code_of(lambda: complete_once(d2, completion(lease.chunk_id, info)))[0] == DENIED
        own = str(Path(info.uri).with_name("evil.shard"))
        shutil.copy(info.uri, own)
        for who in (d1, d2):
            code, why = code_of(lambda who=who: complete_once(who, completion(lease.chunk_id, info, own)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "names" in why
        other = d2.lease_chunk()  # another chunk's lease names another file: not this chunk's
        code, _ = code_of(lambda: complete_once(d2, completion(lease.chunk_id, info, other.shard_uri)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        next_attempt = lease.shard_uri.replace("-a1.shard", "-a2.shard")
        shutil.copy(info.uri, next_attempt)
        assert code_of(lambda: complete_once(d1, completion(lease.chunk_id, info, next_attempt)))[0] == DENIED
        assert chunk() == ("leased", d1.worker_id) and not running.ledger._q("SELECT id FROM shards")
        assert running.ledger.counter("chunk_completions_refused") == 5
        # The holder's completion, and its retry after a lost reply, are taken as before.
        honest = completion(lease.chunk_id, info)
        assert complete_once(d1, honest).accepted
        again = complete_once(d1, honest)
        assert again.accepted and again.reason == "already recorded"
        assert chunk() == ("done", None)
        # A lease that went to another since: not taken (the worker deletes its surplus file).
        d2.fail_chunk(other.chunk_id, "gave up")
        for _ in range(64):  # (other chunks may come first in lease order)
            retaken = d1.lease_chunk()
            if retaken.chunk_id == other.chunk_id:
                break
        assert retaken.chunk_id == other.chunk_id and retaken.shard_uri.endswith("-a2.shard")
        late = complete_once(d2, completion(other.chunk_id, written(other)))
        assert not late.accepted and "leased again" in late.reason
    finally:
        d1.close(), d2.close()
        running.stop()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("diloco")]
    assert not any("\n" in line for line in lines)


@pytest.mark.timeout(120)
def test_a_completed_shard_is_a_regular_file_of_its_bytes_read_after_the_lease_check(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    running = data_run(tiny_corpus, tmp_path)
    d1, d2 = (CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_DATA) for _ in range(2))
    try:
        d1.join(), d2.join()
        lease = d1.lease_chunk()
        info = written(lease)
        data = Path(info.uri).read_bytes()
        Path(info.uri).unlink()
        os.mkfifo(info.uri)  # read whole, a FIFO blocked the handler until a writer came
        started = time.monotonic()
        assert code_of(lambda: complete_once(d2, completion(lease.chunk_id, info)))[0] == DENIED
        reply = complete_once(d1, completion(lease.chunk_id, info))
        assert time.monotonic() - started < 4.0
        assert not reply.accepted and "not a regular file" in reply.reason, reply
        # A sparse 1 GiB file said to be 10 bytes: refused by its size, never read.
        lease = d1.lease_chunk()
        with open(lease.shard_uri, "wb") as f:
            f.truncate(1 << 30)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reply = complete_once(d1, completion(lease.chunk_id, info, lease.shard_uri, shard_bytes=10))
        assert not reply.accepted and f"{1 << 30} bytes in the file, 10 reported" in reply.reason, reply
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB: not read
        # A link to a good shard in the store is not the file itself.
        lease = d1.lease_chunk()
        good = Path(lease.shard_uri).with_name("good.shard")
        good.write_bytes(data)
        os.symlink(good, lease.shard_uri)
        reply = complete_once(d1, completion(lease.chunk_id, info, lease.shard_uri))
        assert not reply.accepted and "not a regular file" in reply.reason, reply
        state = running.ledger._q("SELECT state, attempts FROM chunks WHERE id = ?", (lease.chunk_id,))[0]
        assert tuple(state) == ("pending", 3) and not running.ledger._q("SELECT id FROM shards")
    finally:
        d1.close(), d2.close()
        running.stop()


def test_an_object_is_read_by_its_size_on_s3(s3_server, monkeypatch) -> None:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.create_bucket(f"t-{uuid.uuid4().hex[:12]}")
    uri = f"s3://{bucket}/shards/chunk-000001-a1.shard"
    store.write_bytes_atomic(uri, b"0123456789")
    assert store.read_exact(uri, 10) == b"0123456789"
    fs, _ = store.filesystem(uri)
    read = []
    monkeypatch.setattr(type(fs), "cat_file", lambda *a, **k: read.append(a) or b"")
    for said in (5, 1 << 30):
        with pytest.raises(store.StoreError, match=f"10 bytes in the file, {said} reported"):
            store.read_exact(uri, said)
    with pytest.raises(store.StoreError):
        store.read_exact(f"s3://{bucket}/shards", 10)  # a prefix, not an object
    assert not read  # nothing was read of an object of another size
