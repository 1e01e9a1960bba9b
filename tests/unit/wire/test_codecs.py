"""Outer-gradient codecs: error bounds, error feedback, and the coordinator's side of them."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.coordinator.wirecount import CALL_OVERHEAD_BYTES, framed_bytes
from diloco.data.worker import DataWorker
from diloco.model import build_model, make_inner_optimizer
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire import codecs
from diloco.wire.tensors import stream_tensors
from tests.support import delta_header, ledger_rows, tiny_coordinator

QMAX = {"int8": 127, "int4": 7}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(codecs.CODECS),
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    log_scale=st.floats(-8, 2),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_within_the_codec_bound(codec, shape, log_scale, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10**log_scale
    y = codecs.decode(codecs.encode(x, codec), codec, tuple(shape))
    assert y.shape == x.shape and y.dtype == torch.float32
    if codec == "fp32":
        assert torch.equal(x, y)
        return
    if codec == "bf16":
        assert torch.allclose(y, x, rtol=2**-8, atol=0)
        return
    # Blockwise absmax: each value is off by at most half a quantization step of its block, plus
    # the bf16 rounding of the block's scale.
    flat, err = x.flatten(), (x - y).abs().flatten()
    pad = (-flat.numel()) % codecs.BLOCK
    absmax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, codecs.BLOCK).amax(1)
    bound = absmax.repeat_interleave(codecs.BLOCK)[: flat.numel()] * (0.5 / QMAX[codec] + 2**-7)
    assert bool((err <= bound + 1e-30).all())


def realistic_delta() -> dict[str, torch.Tensor]:
    """A real pseudo-gradient: Θ − θ after 20 AdamW steps of the built-in GPT on random tokens."""
    cfg = RunConfig().with_overrides(
        {"model.kwargs.n_layer": 2, "model.kwargs.n_embd": 64, "model.seq_len": 32}
    )
    model = build_model(cfg.model, 257, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_inner_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        batch = torch.randint(0, 257, (8, 33), generator=gen)
        loss = model({"input_ids": batch})
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_int4_relative_error_on_a_real_pseudo_gradient_and_error_feedback():
    delta = realistic_delta()
    flat = torch.cat([t.flatten() for t in delta.values()])
    decoded = torch.cat(
        [codecs.decode(codecs.encode(t, "int4"), "int4", tuple(t.shape)).flatten() for t in delta.values()]
    )
    assert (decoded - flat).norm() / flat.norm() < 0.15
    # With error feedback, what was dropped is sent later: the sum of 10 sends tracks 10 deltas to
    # within one round's quantization error, instead of accumulating it.
    w = delta["transformer.h.0.mlp.c_fc.weight"]
    residual, sent = None, torch.zeros_like(w)
    for _ in range(10):
        blob, residual = codecs.encode_with_feedback(w, "int4", residual)
        sent += codecs.decode(blob, "int4", tuple(w.shape))
    assert (sent - 10 * w).norm() / (10 * w).norm() < 0.02


def test_the_way_back_keeps_quantization_error_at_one_steps_worth():
    # The coordinator sends each merged step against what learners hold, so the held copy stays
    # within one step's int4 error of the target for good; adding up separately encoded steps
    # instead drifts further with every step.
    gen = torch.Generator().manual_seed(0)
    target, held, summed = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    for _ in range(50):
        step = torch.randn(4096, generator=gen) * 1e-2
        target += step
        before = held
        blob, held = codecs.encode_step(target, held, "int4")
        assert torch.equal(held, before + codecs.decode(blob, "int4", (4096,))), "what a receiver holds"
        summed += codecs.decode(codecs.encode(step, "int4"), "int4", (4096,))
        assert (held - target).norm() / step.norm() < 0.15
    assert (summed - target).norm() / step.norm() > 0.5


def test_int4_and_int8_are_small_on_the_wire():
    w = realistic_delta()["transformer.h.0.mlp.c_fc.weight"]
    assert len(codecs.encode(w, "int4")) < 0.56 * w.numel()
    assert len(codecs.encode(w, "int8")) < 1.05 * w.numel()


def test_blobs_that_do_not_match_are_refused():
    x = torch.randn(100)
    blob = codecs.encode(x, "int8")
    with pytest.raises(codecs.CodecError):
        codecs.decode(blob, "int8", (101,))  # another tensor's size
    with pytest.raises(codecs.CodecError):
        codecs.decode(blob, "int4", (100,))  # another codec
    with pytest.raises(codecs.CodecError):
        codecs.decode(blob[:-3], "int8", (100,))  # truncated
    with pytest.raises(codecs.CodecError):
        codecs.decode(codecs.encode(torch.full((100,), float("nan")), "bf16"), "bf16", (100,))


@pytest.fixture
def int8_coordinator(tiny_corpus: Path, tmp_path: Path):
    with tiny_coordinator(tiny_corpus, tmp_path, {"sync.codec": "int8"}) as (running, learner, init):
        yield running, learner, init, tmp_path


@pytest.mark.timeout(120)
def test_coordinator_decodes_its_codec_and_refuses_another(int8_coordinator):
    running, learner, init, workdir = int8_coordinator
    delta = {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}
    with pytest.raises(grpc.RpcError) as refused:
        learner.push(delta_header(learner, "fp32", "p-fp32"), delta)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "codec" in refused.value.details()
    assert ledger_rows(workdir, "SELECT COUNT(*) FROM pushes") == [(0,)]

    blobs = {
        n: torch.frombuffer(bytearray(codecs.encode(t, "int8")), dtype=torch.uint8) for n, t in delta.items()
    }
    reply = learner.push(delta_header(learner, "int8", "p-int8"), blobs)
    assert reply.accepted
    # As a learner does: wait for the merge that holds the push to be published.
    ((_, pulled),) = learner.pull([0], [-1], wait_s=10, wait_above=[reply.version])
    # The fragment's first merge, where the outer step's warm-up (sync.outer_warmup_rounds) is
    # plain averaging: the global parameters minus the decoded delta.
    for name, value in pulled.items():
        expected = init[name] - codecs.decode(codecs.encode(delta[name], "int8"), "int8", tuple(value.shape))
        torch.testing.assert_close(value, expected)


@pytest.mark.timeout(120)
def test_push_bytes_are_counted_exactly_and_a_cut_stream_changes_nothing(int8_coordinator):
    running, learner, init, workdir = int8_coordinator
    delta = {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}
    blobs = {
        n: torch.frombuffer(bytearray(codecs.encode(t, "int8")), dtype=torch.uint8) for n, t in delta.items()
    }
    header = delta_header(learner, "int8", "p-cut")
    header.worker_id = learner.worker_id
    messages = list(stream_tensors(header, blobs, 4096))
    assert len(messages) > 3

    def cut_short():  # the connection dies after two pieces
        yield from messages[:3]
        raise ConnectionError("link lost")

    before = running.service.wire.received.get("push", 0)
    with pytest.raises(grpc.RpcError):
        learner.stub.PushDelta(cut_short(), timeout=30)
    assert ledger_rows(workdir, "SELECT COUNT(*) FROM pushes") == [(0,)], "a partial push was recorded"

    wire = running.service.wire
    # The cut call's handler may still be reading what arrived of it: wait until it is done.
    deadline, seen = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        now = (wire.received.get("push", 0), wire.calls.get("push", 0))
        if now == seen:
            break
        seen = now
        time.sleep(0.3)
    counted_before, calls_before = wire.received.get("push", 0), wire.calls.get("push", 0)
    reply = learner.stub.PushDelta(iter(messages), timeout=30)
    assert reply.accepted
    # Every message with its gRPC prefix and HTTP/2 frame headers, and the call's own headers.
    framed = sum(framed_bytes(m.ByteSize()) for m in messages)
    assert wire.calls["push"] - calls_before == 1
    assert wire.received["push"] - counted_before == framed + CALL_OVERHEAD_BYTES // 2
    assert counted_before >= before
    assert running.service.wait_published()
    assert ledger_rows(workdir, "SELECT COUNT(*), MAX(state) FROM pushes") == [(1, "merged")]
    assert np.isfinite(ledger_rows(workdir, "SELECT value FROM counters WHERE name = 'tokens_merged'")[0][0])


@pytest.mark.timeout(120)
def test_pulls_as_encoded_steps_rebuild_exactly_what_a_full_pull_sends(tiny_corpus: Path, tmp_path: Path):
    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32,
        "model.kwargs.n_head": 2, "sync.fragments": 1, "sync.quorum": 1, "sync.grace_factor": 0.0,
        "sync.codec": "int8", "sync.pull_codec": "int4",
    })  # fmt: skip
    running = start_coordinator(cfg, str(tmp_path))
    address = f"127.0.0.1:{running.port}"
    try:
        assert DataWorker(address).run() == 0
        learner = CoordinatorClient(address, pb.ROLE_COMPUTE)
        model_cfg = RunConfig.from_json(learner.join().config_json).model
        init = {
            n: p.detach().clone()
            for n, p in build_model(model_cfg, model_cfg.vocab_size, 0).named_parameters()
        }
        assert learner.init_parameters(init).accepted
        gen = torch.Generator().manual_seed(0)
        for version in range(3):
            delta = {n: torch.randn(t.shape, generator=gen) * 1e-2 for n, t in init.items()}
            blobs = {
                n: torch.frombuffer(bytearray(codecs.encode(t, "int8")), dtype=torch.uint8)
                for n, t in delta.items()
            }
            header = delta_header(learner, "int8", f"p{version}")
            header.version = version
            assert learner.push(header, blobs).accepted
        assert running.service.wait_published()
        wire = running.service.wire
        joined = wire.sent["pull_join"]
        ((full_header, full),) = learner.pull([0], [-1])  # holding nothing: a join's pull
        full_bytes = wire.sent["pull_join"] - joined
        sent = wire.sent["pull"]
        steps = learner.pull([0], [0])
        step_bytes = wire.sent["pull"] - sent
        assert full_header.version == 3 and not full_header.delta
        # One step per published version: the publisher may have published merges in a group.
        versions = [h.version for h, _ in steps]
        assert versions == sorted(set(versions)) and versions[-1] == 3
        assert all(h.delta and h.codec == "int4" for h, _ in steps)
        rebuilt = {n: t.clone() for n, t in init.items()}
        for _header, blobs in steps:
            for name, blob in blobs.items():
                rebuilt[name] += codecs.decode(blob.numpy().tobytes(), "int4", tuple(rebuilt[name].shape))
        for name in init:
            assert torch.equal(rebuilt[name], full[name]), name
        # The coordinator's error feedback keeps the learners' copy on top of Θ itself.
        theta = running.service.fragments[0].params
        for name in init:
            assert (full[name] - theta[name]).norm() <= 0.15 * (theta[name] - init[name]).norm() + 1e-6
        assert step_bytes < 0.5 * full_bytes  # three int4 steps cost less than one fp32 fragment
        # A learner whose push was refused waits above no version and may hold the latest: it gets
        # it whole (no steps lead there), not an empty answer it would ask again for at once.
        ((again_header, again),) = learner.pull([0], [3], wait_s=1.0, wait_above=[-1])
        assert again_header.version == 3 and not again_header.delta
        assert all(torch.equal(again[n], full[n]) for n in init)
        learner.close()
    finally:
        running.stop()


def test_wire_counts_frame_every_message_and_split_by_role():
    from diloco.coordinator.wirecount import WireCounter

    # gRPC's 5-byte prefix, then one 9-byte HTTP/2 frame header per 16 KiB frame.
    assert framed_bytes(0) == 5 + 9
    assert framed_bytes(16384 - 5) == 16384 + 9
    assert framed_bytes(16384 - 4) == 16385 + 18
    wire = WireCounter()
    request = pb.HeartbeatRequest(worker_id="w")
    wire.unary_in("heartbeat", request, "data")
    wire.add_out("heartbeat", pb.HeartbeatReply(), "data")
    wire.unary_in("push", request)  # push is a learner's RPC whoever sends it
    wire.unary_in("status", pb.StatusRequest())
    roles = wire.by_role()
    assert roles["data"]["received"] == framed_bytes(request.ByteSize()) + CALL_OVERHEAD_BYTES // 2
    assert set(roles) == {"data", "compute", "observer"}
    received, _ = wire.totals()
    assert received == roles["data"]["received"] + roles["compute"]["received"]  # monitoring left out


@given(
    tensor=st.integers(0, 2**31),
    offset=st.integers(0, 2**40),
    nbytes=st.sampled_from([0, 1, 127, 128, 16383, 16384, 1 << 20]),
)
@settings(max_examples=60, deadline=None)
def test_piece_sizes_are_computed_exactly(tensor: int, offset: int, nbytes: int):
    from diloco.coordinator.wirecount import message_size

    msg = pb.TensorStreamMessage(piece=pb.TensorPiece(tensor=tensor, offset=offset, data=b"x" * nbytes))
    assert message_size(msg) == msg.ByteSize()
    header = pb.TensorStreamMessage(header=pb.TensorHeader(fragment=1, push_id="abc"))
    assert message_size(header) == header.ByteSize()


@pytest.mark.timeout(120)
def test_a_burst_of_merges_is_checkpointed_once(tiny_corpus: Path, tmp_path: Path):
    overrides = {"coordinator.min_publish_interval_s": 5.0}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, learner, init):
        shard = learner.call("LeaseShard", pb.LeaseShardRequest()).shard_id
        for i in range(4):  # quorum 1: four merges, the last three while the publisher waits
            # 10 steps of a row each (tiny_coordinator's batch of 1), their 10 rows named
            header = pb.TensorHeader(fragment=0, version=i, inner_steps=10, tokens=1290, push_id=f"burst-{i}")
            header.spans.add(shard_id=shard, row_start=10 * i, row_end=10 * i + 10)
            delta = {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}
            assert learner.push(header, delta).accepted
        assert running.service.wait_published(30)
        files = sorted(
            int(p.stem.rsplit("-v", 1)[1]) for p in (tmp_path / "checkpoints").glob("fragment-0-*")
        )
    # Every merge is committed, but the ones that came in a burst share one checkpoint: the
    # version before the newest on disk is not 3 (it would be, one file per merge).
    assert ledger_rows(tmp_path, "SELECT COUNT(*) FROM pushes WHERE state = 'merged'") == [(4,)]
    assert files[-1] == 4 and 3 not in files, files
