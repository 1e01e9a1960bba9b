"""Survive kill -9 anywhere: chaos with real processes, lost replies, SIGTERM, poison, corruption."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator as start_in_process
from diloco.data.worker import DataWorker
from diloco.local.procs import ProcessGroup
from diloco.model import build_model
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pb_grpc
from tests.support import QUICK_END, ledger_rows, run_cli, start_coordinator, status, wait_for, worker_id_of

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_chaos_run_survives_kills_of_every_role_and_passes_the_audit(
    small_corpus: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "run"
    result = run_cli([
        "run", "--dataset", str(small_corpus), "--minutes", "0.9", "--chaos-interval", "2.5", "--learners", "2",
        "--data-workers", "2", "--workdir", str(workdir), "--inner-steps", "20", "--seed", "3", "--no-progress",
        "--set", "data.chunk_bytes=65536", "--set", "coordinator.lease_ttl_s=6", "--set", "coordinator.heartbeat_s=1", *QUICK_END,
    ], timeout=280)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    kills = summary["kills"]
    assert sum(kills.values()) >= 10, kills
    assert kills.get("coordinator", 0) >= 1, kills
    assert summary["audit_ok"], summary["audit_violations"]
    assert summary["tokens_merged"] > 0 and summary["rounds"] >= 1
    assert summary["eval_loss"] is not None and summary["eval_loss"] < summary["first_loss"]
    audit = run_cli(["status", "--audit", "--workdir", str(workdir)], timeout=60)
    assert audit.returncode == 0 and "audit ok" in audit.stdout, audit.stdout + audit.stderr


class LostReply(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "reply lost (test)"


class DropFirstReply(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """The server does the work; the client never hears about it, once per named method."""

    def __init__(self, methods: set[str]):
        self.methods = methods
        self.dropped: list[str] = []

    def _maybe_drop(self, details, call):
        call.result()  # the server has answered
        name = details.method.rsplit("/", 1)[-1]
        if name in self.methods and name not in self.dropped:
            self.dropped.append(name)
            raise LostReply()
        return call

    def intercept_unary_unary(self, continuation, details, request):
        return self._maybe_drop(details, continuation(details, request))

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return self._maybe_drop(details, continuation(details, request_iterator))


def drop_replies(client: CoordinatorClient, methods: set[str]) -> DropFirstReply:
    interceptor = DropFirstReply(methods)
    client.channel = grpc.intercept_channel(client.channel, interceptor)
    client.stub = pb_grpc.CoordinatorStub(client.channel)
    return interceptor


@pytest.mark.timeout(120)
def test_retries_after_lost_replies_have_no_second_effect(tiny_corpus: Path, tmp_path: Path) -> None:
    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32,
        "model.kwargs.n_head": 2, "sync.fragments": 1, "sync.quorum": 1, "sync.grace_factor": 0.0,
    })  # fmt: skip
    running = start_in_process(cfg, str(tmp_path))
    address = f"127.0.0.1:{running.port}"
    try:
        worker = DataWorker(address)
        dropped = drop_replies(worker.client, {"CompleteChunk"})
        assert worker.run() == 0
        assert dropped.dropped == ["CompleteChunk"]
        pairs = ledger_rows(
            tmp_path,
            "SELECT c.id, COUNT(s.id) FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id",
        )
        assert all(n == 1 for _, n in pairs), pairs

        learner = CoordinatorClient(address, pb.ROLE_COMPUTE)
        join = learner.join()
        model_cfg = RunConfig.from_json(join.config_json).model
        init = {
            n: p.detach().clone()
            for n, p in build_model(model_cfg, model_cfg.vocab_size, 0).named_parameters()
        }
        assert learner.init_parameters(init).accepted
        shard = learner.call("LeaseShard", pb.LeaseShardRequest())
        delta = {n: torch.full_like(t, 0.01) for n, t in init.items()}
        # H steps: a whole round's work, so its merge is a whole outer step (merging.work_fraction).
        header = pb.TensorHeader(
            fragment=0, version=0, inner_steps=cfg.train.inner_steps, tokens=4 * (model_cfg.seq_len + 1)
        )
        header.spans.add(shard_id=shard.shard_id, row_start=0, row_end=4)
        dropped = drop_replies(learner, {"PushDelta"})
        reply = learner.push(header, delta)
        assert dropped.dropped == ["PushDelta"] and reply.accepted
        assert ledger_rows(tmp_path, "SELECT COUNT(*), MAX(state) FROM pushes") == [(1, "merged")]
        ((_, pulled),) = learner.pull([0], [-1])
        # One merge, once: θ1 = θ0 − g (the first merge of the outer step's warm-up is plain
        # averaging; a second application would have moved it by 2g).
        for name, value in pulled.items():
            torch.testing.assert_close(value, init[name] - 0.01 * torch.ones_like(value))
        assert status(address)["fragment_versions"] == [1]
        tokens = ledger_rows(tmp_path, "SELECT value FROM counters WHERE name = 'tokens_merged'")[0][0]
        assert tokens == 4 * (model_cfg.seq_len + 1)
        learner.close()
    finally:
        running.stop()


@pytest.mark.timeout(180)
def test_sigterm_returns_leases_and_exits_zero(small_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(
            group, workdir, ["--dataset", str(small_corpus), "--set", "train.threads=1"]
        )
        data = group.spawn("data-0", "data", ["data", "--coordinator", address])
        learner = group.spawn("learner-0", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        learner_id = worker_id_of(learner)
        held = "SELECT COUNT(*) FROM shards WHERE holder = ? AND state = 'leased'"
        wait_for(
            lambda: ledger_rows(workdir, held, (learner_id,))[0][0] > 0, 90, "the learner to lease shards"
        )
        group.signal(learner, signal.SIGTERM)
        assert group.wait([learner], 30) and learner.proc.returncode == 0, group.tail(learner)
        assert ledger_rows(workdir, held, (learner_id,))[0][0] == 0, "the learner's shard leases outlived it"
        assert ledger_rows(workdir, "SELECT state FROM workers WHERE id = ?", (learner_id,)) == [("left",)]
        group.stop([data], grace_s=30)
        assert data.proc.returncode == 0, group.tail(data)
        coordinator = group.by_role("coordinator")[0]
        group.stop([coordinator], grace_s=30)
        assert coordinator.proc.returncode == 0
        assert run_cli(["status", "--audit", "--workdir", str(workdir)], timeout=60).returncode == 0
    finally:
        group.stop()


@pytest.mark.timeout(180)
def test_a_poison_chunk_is_quarantined_and_the_run_goes_on(tmp_path: Path) -> None:
    dataset = tmp_path / "data"
    dataset.mkdir()
    for i in range(4):
        (dataset / f"part{i}.txt").write_text(f"line {i} of some text\n" * 3000)
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, [
            "--dataset", str(dataset), "--set", "data.chunk_bytes=60000", "--set", "coordinator.max_chunk_attempts=2",
        ])  # fmt: skip
        (dataset / "part2.txt").unlink()  # partitioned, then gone: every attempt at its chunk fails
        data = group.spawn("data-0", "data", ["data", "--coordinator", address])
        assert group.wait([data], 90) and data.proc.returncode == 0, group.tail(data)
        poisoned = ledger_rows(workdir, "SELECT COUNT(*) FROM chunks WHERE spec LIKE '%part2.txt%'")[0][0]
        detail = status(address)
        assert poisoned >= 1 and detail["chunks_quarantined"] == poisoned
        assert detail["chunks_done"] == detail["chunks_total"] - poisoned
        assert all("part2.txt" in q["error"] for q in detail["quarantined"])
    finally:
        group.stop()


@pytest.mark.timeout(240)
def test_a_corrupt_shard_is_reprocessed_from_its_chunk(tiny_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, [
            "--dataset", str(tiny_corpus), "--set", "data.chunk_bytes=32768", "--set", "train.inner_steps=10",
            "--set", "sync.overlap_steps=3", "--set", "train.threads=1",
            "--set", "model.kwargs.n_layer=1",  # the learner runs the data out: the repair is tested
        ])  # fmt: skip
        first = group.spawn("data-0", "data", ["data", "--coordinator", address])
        assert group.wait([first], 60) and first.proc.returncode == 0
        ((sid, uri, checksum),) = ledger_rows(
            workdir, "SELECT id, uri, checksum FROM shards WHERE split = 'train' ORDER BY id LIMIT 1"
        )
        raw = bytearray(Path(uri).read_bytes())
        raw[-10] ^= 0xFF  # one flipped bit of payload
        Path(uri).write_bytes(bytes(raw))
        learner = group.spawn("learner-0", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        state = "SELECT state FROM shards WHERE id = ?"
        wait_for(
            lambda: ledger_rows(workdir, state, (sid,)) == [("corrupt",)],
            90,
            "the corrupt shard to be reported",
        )
        group.spawn("data-1", "data", ["data", "--coordinator", address])
        wait_for(
            lambda: ledger_rows(workdir, state, (sid,))[0][0] in ("ready", "leased", "consumed"),
            90,
            "the repair",
        )
        ((new_uri, new_checksum),) = ledger_rows(
            workdir, "SELECT uri, checksum FROM shards WHERE id = ?", (sid,)
        )
        assert new_uri != uri and new_checksum == checksum  # the same rows, from the raw chunk again
        assert ledger_rows(workdir, "SELECT value FROM counters WHERE name = 'shards_repaired'") == [(1.0,)]
        assert group.wait([learner], 180) and learner.proc.returncode == 0, group.tail(learner)
        assert run_cli(["status", "--audit", "--workdir", str(workdir)], timeout=60).returncode == 0
    finally:
        group.stop()
