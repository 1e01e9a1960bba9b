"""Workers against a coordinator that lies (a spoofed address, a compromised server): the code a
worker imports, where a data worker writes its shard and what it reads are its own operator's to
allow, not the coordinator's to name (red-team round 2, defects 4, 5 and 6)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from diloco import plugins
from diloco.client import CoordinatorClient
from diloco.compute.handshake import join_run
from diloco.config import RunConfig
from diloco.data.worker import DataWorker, dataset_roots
from diloco.errors import DilocoError
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc as pbg

TOY = "tests.toy_models:tiny_lm"


class FakeCoordinator(pbg.CoordinatorServicer):
    """Answers Join with `config`, leases one chunk (`lease`), records what workers report."""

    def __init__(self, config: dict[str, Any], lease: pb.LeaseChunkReply | None = None) -> None:
        self.config, self.lease, self.seen = config, lease, []

    def Join(self, request: Any, context: Any) -> pb.JoinReply:
        return pb.JoinReply(
            worker_id=request.worker_id or "w", config_json=json.dumps(self.config), coordinator_epoch=1,
            needs_init=False, num_fragments=1, heartbeat_s=30.0, tokenizer_hash="",
        )  # fmt: skip

    def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatReply:
        return pb.HeartbeatReply()

    def Leave(self, request: Any, context: Any) -> pb.LeaveReply:
        self.seen.append(f"Leave {request.reason}")
        return pb.LeaveReply()

    def LeaseChunk(self, request: Any, context: Any) -> pb.LeaseChunkReply:
        lease, self.lease = self.lease, None
        return lease or pb.LeaseChunkReply(done=True)

    def CompleteChunk(self, request: Any, context: Any) -> pb.CompleteChunkReply:
        self.seen.append(f"CompleteChunk {request.shard_uri}")
        return pb.CompleteChunkReply(accepted=True)

    def FailChunk(self, request: Any, context: Any) -> pb.FailChunkReply:
        self.seen.append(f"FailChunk {request.error}")
        return pb.FailChunkReply()


@contextmanager
def fake_coordinator(fake: FakeCoordinator) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pbg.add_CoordinatorServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(autouse=True)
def nothing_allowed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's operator allowed nothing beyond the built-ins (unless a test says so)."""
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    monkeypatch.setattr(plugins, "_allowed_here", set())


def run_config(**sections: dict[str, Any]) -> dict[str, Any]:
    cfg = json.loads(RunConfig().to_json())
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


def learner_joins(address: str) -> None:
    client = CoordinatorClient(address, pb.ROLE_COMPUTE, worker_id="victim-learner")
    try:
        join_run(client, connect_timeout_s=10, device="cpu", threads=1, mark=lambda _: None)
    finally:
        client.close()


# -- 4: the code a worker imports ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_learner_refuses_a_factory_its_operator_did_not_allow(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    evil = {
        "factory": "subprocess:run",
        "kwargs": {"args": f"id > {marker}", "shell": True},
        "vocab_size": 512,
    }
    fake = FakeCoordinator(run_config(model=evil))
    with fake_coordinator(fake) as address, pytest.raises(DilocoError) as refused:
        learner_joins(address)
    assert not marker.exists()  # nothing of it ran
    said = str(refused.value)
    assert "model.factory 'subprocess:run' from the coordinator is not allowed here" in said
    assert "--model subprocess:run" in said and "\n" not in said
    assert any(s.startswith("Leave refused: model.factory") for s in fake.seen), fake.seen


@pytest.mark.timeout(60)
def test_a_learner_builds_a_factory_its_operator_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCoordinator(run_config(model={"factory": TOY, "kwargs": {"width": 8}, "vocab_size": 257}))
    with fake_coordinator(fake) as address:
        with pytest.raises(DilocoError, match=f"pass --model {TOY}"):
            learner_joins(address)
        plugins.allow(TOY)  # `diloco compute --model tests.toy_models:tiny_lm`
        learner_joins(address)
        monkeypatch.setattr(plugins, "_allowed_here", set())
        monkeypatch.setenv(plugins.ALLOW_ENV, f"other.module:fn, {TOY}")  # or DILOCO_ALLOW_CODE
        learner_joins(address)


def test_the_coordinator_cannot_ask_a_built_in_factory_to_run_a_repositorys_code() -> None:
    model = RunConfig().model
    model.factory, model.kwargs = (
        "diloco.model.hf:causal_lm",
        {"pretrained": "evil/repo", "trust_remote_code": True},
    )
    with pytest.raises(DilocoError, match="trust_remote_code"):
        plugins.refuse_untrusted_model(model)
    plugins.allow("diloco.model.hf:causal_lm")  # its operator's word
    plugins.refuse_untrusted_model(model)


@pytest.mark.timeout(60)
def test_a_data_worker_refuses_a_preprocess_its_operator_did_not_allow(tmp_path: Path) -> None:
    data = {"preprocess": "os:system", "store": str(tmp_path / "store"), "dataset": str(tmp_path)}
    fake = FakeCoordinator(run_config(data=data))
    with fake_coordinator(fake) as address, pytest.raises(DilocoError, match="pass --preprocess os:system"):
        DataWorker(address, threading.Event(), 10, "victim-data").run()


# -- 5: where a data worker writes ----------------------------------------------------------------


def secret_lease(target: Path, secret: Path) -> pb.LeaseChunkReply:
    size = secret.stat().st_size
    return pb.LeaseChunkReply(
        chunk_id=1, split="train", shard_uri=str(target), lease_ttl_s=60,
        segments=[pb.Segment(uri=str(secret), start=0, end=size, file_end=True)],
    )  # fmt: skip


@pytest.fixture
def victim(tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "victim_home"
    home.mkdir()
    (home / ".bashrc").write_text("alias ls='ls --color'\n")
    (home / "secret.txt").write_text("AWS_SECRET_ACCESS_KEY=hunter2\n" * 3)
    return home / ".bashrc", home / "secret.txt"


@pytest.mark.timeout(60)
def test_a_data_worker_refuses_a_run_without_a_shard_store(tmp_path: Path, victim: tuple[Path, Path]) -> None:
    bashrc, secret = victim
    (tmp_path / "corpus").mkdir()
    fake = FakeCoordinator(
        run_config(data={"store": "", "dataset": str(tmp_path / "corpus")}), secret_lease(bashrc, secret)
    )
    with fake_coordinator(fake) as address, pytest.raises(DilocoError, match="named no data.store"):
        DataWorker(address, threading.Event(), 10, "victim-data", read_roots=(str(secret),)).run()
    assert bashrc.read_text() == "alias ls='ls --color'\n"
    assert not any(s.startswith("CompleteChunk") for s in fake.seen)


@pytest.mark.timeout(60)
def test_a_data_worker_writes_only_under_the_shard_store(tmp_path: Path, victim: tuple[Path, Path]) -> None:
    bashrc, secret = victim
    data = {"store": str(tmp_path / "store"), "dataset": str(secret.parent)}
    fake = FakeCoordinator(run_config(data=data), secret_lease(bashrc, secret))
    with fake_coordinator(fake) as address:
        assert DataWorker(address, threading.Event(), 10, "victim-data").run() == 0
    assert bashrc.read_text() == "alias ls='ls --color'\n"
    assert [s for s in fake.seen if s.startswith(("CompleteChunk", "FailChunk"))] == [
        f"FailChunk shard URI {str(bashrc)!r} is outside the run's shard store"
    ]


# -- 6: what a data worker reads ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_data_worker_without_read_root_reads_only_the_joined_dataset(
    tmp_path: Path, victim: tuple[Path, Path]
) -> None:
    _, secret = victim
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    store_dir = tmp_path / "store"
    shard = store_dir / "shards" / "chunk-1.shard"
    data = {"store": str(store_dir), "dataset": str(corpus)}
    fake = FakeCoordinator(run_config(data=data), secret_lease(shard, secret))
    with fake_coordinator(fake) as address:
        assert DataWorker(address, threading.Event(), 10, "victim-data").run() == 0
    assert not shard.exists()
    failed = [s for s in fake.seen if s.startswith(("CompleteChunk", "FailChunk"))]
    assert failed == [f"FailChunk segment {str(secret)!r} is outside this worker's read roots (--read-root)"]


def test_the_default_read_root_is_the_dataset_s_fixed_part(tmp_path: Path) -> None:
    assert dataset_roots("s3://bucket/corpus/") == ("s3://bucket/corpus/",)
    assert dataset_roots("s3://bucket/corpus/*.jsonl") == ("s3://bucket/corpus",)
    assert dataset_roots(str(tmp_path / "raw" / "part-*.txt")) == (str(tmp_path / "raw"),)
    assert dataset_roots("stdlib")[0].endswith(("python3.11", "python3.12", "python3.13", "lib"))
