"""Two copies of one push arriving together (a client's retry while the first still streams) are
answered like a retry after a lost reply: the second gets the first's answer, nothing happens twice."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
import torch

from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import stream_tensors
from tests.support import delta_header, ledger_rows, tiny_coordinator


@pytest.mark.timeout(120)
def test_a_copy_of_a_push_still_streaming_gets_the_answer_of_a_retry(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {"data.epochs": 4}) as (running, learner, init):
        ledger = running.service.ledger
        reads, real_push_state = threading.Semaphore(0), ledger.push_state

        def push_state(push_id: str):  # each copy's "is it recorded?" is seen here
            row = real_push_state(push_id)
            reads.release()
            return row

        monkeypatch.setattr(ledger, "push_state", push_state)
        header = delta_header(learner, "fp32", "twice")
        header.worker_id = learner.worker_id
        delta = {n: torch.full_like(t, 1e-3) for n, t in init.items()}
        messages = list(stream_tensors(header, delta, 1 << 20))
        go = threading.Event()

        def held():  # the first copy: its header, then nothing until the second is answered
            yield messages[0]
            go.wait(30)
            yield from messages[1:]

        first: list[pb.PushReply | grpc.RpcError] = []

        def send_first() -> None:
            try:
                first.append(learner.stub.PushDelta(held(), timeout=30))
            except grpc.RpcError as e:
                first.append(e)

        sender = threading.Thread(target=send_first, daemon=True)
        sender.start()
        try:
            assert reads.acquire(timeout=20), "the first copy did not get to its ledger read"
            second = learner.stub.PushDelta(iter(messages), timeout=30)  # read "not recorded" too
        finally:
            go.set()
            sender.join(30)
        assert second.accepted and second.reason == "queued for merge"
        (reply,) = first
        assert isinstance(reply, pb.PushReply), f"the first copy failed: {reply}"
        assert reply.accepted and reply.reason.startswith("already received")
        assert ledger_rows(tmp_path, "SELECT COUNT(*) FROM pushes WHERE push_id = 'twice'") == [(1,)]
        assert ledger.counter("pushes_received") == 1
