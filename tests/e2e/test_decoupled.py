"""Decoupled DiLoCo with real processes: nobody waits for a stopped learner, a late learner
contributes, and the synchronous special case computes exactly synchronous DiLoCo."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator import merging
from diloco.coordinator.checkpoint import load_model_params
from diloco.data.shard import read_shard
from diloco.local.procs import ProcessGroup
from diloco.model import build_model, lr_at, make_inner_optimizer
from tests.support import ledger_rows, start_coordinator, status, wait_for, worker_id_of

pytestmark = pytest.mark.e2e

DECOUPLED = [
    "--set", "data.chunk_bytes=65536", "--set", "train.inner_steps=20", "--set", "sync.overlap_steps=4",
    "--set", "sync.quorum=1", "--set", "sync.fragments=2", "--set", "train.threads=1",
    "--set", "coordinator.lease_ttl_s=4", "--set", "coordinator.heartbeat_s=1",
    # A one-layer model resting between steps: three learners that do not take every core the
    # suite has, at about the pace (and so the data use) of the default model on shared cores.
    "--set", "model.kwargs.n_layer=1", "--set", "train.step_delay_s=0.15",
]  # fmt: skip


def merged_pushes_by(workdir: Path, worker_id: str, since: float = 0.0) -> int:
    sql = "SELECT COUNT(*) FROM pushes WHERE worker_id = ? AND state = 'merged' AND received > ?"
    return ledger_rows(workdir, sql, (worker_id, since))[0][0]


def spawn_learners(group: ProcessGroup, address: str, n: int, first: int = 0) -> list:
    return [
        group.spawn(f"learner-{i}", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        for i in range(first, first + n)
    ]


def finish_and_reap(group: ProcessGroup, address: str, learners: list) -> None:
    from diloco.client import CoordinatorClient
    from diloco.v1 import coordinator_pb2 as pb

    client = CoordinatorClient(address, pb.ROLE_OBSERVER)
    client.stub.Finish(pb.FinishRequest(reason="test over"), timeout=10)
    client.close()
    assert group.wait(learners, timeout_s=90), "learners did not finish"
    assert [c.proc.returncode for c in learners] == [0] * len(learners), [group.tail(c) for c in learners]


def assert_no_row_merged_twice(workdir: Path) -> None:
    spans = ledger_rows(workdir, """
        SELECT s.shard_id, s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id
        WHERE p.state = 'merged' ORDER BY s.shard_id, s.row_start""")  # fmt: skip
    for (sid_a, _, end_a), (sid_b, start_b, _) in zip(spans, spans[1:], strict=False):
        assert sid_a != sid_b or end_a <= start_b, "a row was merged twice"


@pytest.mark.timeout(300)
def test_a_stopped_learner_stops_nobody_and_catches_up(small_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, ["--dataset", str(small_corpus), *DECOUPLED])
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        learners = spawn_learners(group, address, 3)
        victim = learners[2]
        victim_id = worker_id_of(victim)
        wait_for(lambda: status(address)["rounds"] >= 6, 120, "the first merges")

        os.kill(victim.proc.pid, signal.SIGSTOP)
        before = sum(status(address)["fragment_versions"])
        time.sleep(10)  # well past the 4 s lease: the syncer counts it dead
        assert not next(w for w in status(address)["workers"] if w["worker_id"] == victim_id)["alive"]
        # The others go on merging while it stays stopped. Bounded in time rather than a fixed
        # window: on cores shared with another test a round takes longer.
        wait_for(
            lambda: sum(status(address)["fragment_versions"]) >= before + 2, 60, "the others to go on merging"
        )

        os.kill(victim.proc.pid, signal.SIGCONT)
        resumed = time.time()
        wait_for(
            lambda: merged_pushes_by(workdir, victim_id, resumed) >= 2,
            120,
            "the stopped learner to contribute again",
        )
        assert next(w for w in status(address)["workers"] if w["worker_id"] == victim_id)["alive"]
        finish_and_reap(group, address, learners)
        assert_no_row_merged_twice(workdir)
    finally:
        group.stop()


@pytest.mark.timeout(300)
def test_b_a_learner_joining_mid_run_contributes(small_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, ["--dataset", str(small_corpus), *DECOUPLED])
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        learners = spawn_learners(group, address, 2)
        wait_for(lambda: status(address)["rounds"] >= 6, 120, "the first merges")
        (late,) = spawn_learners(group, address, 1, first=2)
        late_id = worker_id_of(late)
        wait_for(lambda: merged_pushes_by(workdir, late_id) >= 2, 120, "the late learner's pushes to merge")
        # It started from the fragments as they were when it joined, not from the initialisation.
        joined_at = re.search(r"versions \[([\d, ]+)\]", late.log_path.read_text())
        assert joined_at and all(int(v) > 0 for v in joined_at.group(1).split(","))
        finish_and_reap(group, address, [*learners, late])
        assert_no_row_merged_twice(workdir)
    finally:
        group.stop()


@pytest.mark.timeout(300)
def test_c_quorum_all_one_fragment_is_synchronous_diloco(tiny_corpus: Path, tmp_path: Path) -> None:
    """K = M, P = 1, τ = 0 on real processes gives the global parameters that synchronous DiLoCo,
    replayed here step by step on the very rows each learner was given, computes."""
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, [
            "--dataset", str(tiny_corpus), "--set", "data.chunk_bytes=32768", "--set", "train.inner_steps=5",
            "--set", "sync.quorum=2", "--set", "sync.fragments=1", "--set", "sync.overlap_steps=0",
            "--set", "train.threads=1", "--set", "model.kwargs.n_layer=2", "--set", "model.kwargs.n_embd=64",
            # One shard at a time: the replay below trains a push's spans in the order recorded.
            "--set", "data.mix_shards=1",
        ])  # fmt: skip
        # Every shard is made before the learners start: a learner starved for its first shard
        # says "nothing from me this round" (an empty push), the round closes without it, and
        # its first push is then based on an older version, which synchronous DiLoCo never does.
        data = group.spawn("data-0", "data", ["data", "--coordinator", address])
        assert group.wait([data], timeout_s=120), "the data worker did not make the shards"
        learners = spawn_learners(group, address, 2)
        assert group.wait(learners, timeout_s=240), "learners did not run the data out"
        assert [c.proc.returncode for c in learners] == [0, 0]
    finally:
        group.stop()

    cfg = RunConfig.from_json(ledger_rows(workdir, "SELECT value FROM meta WHERE key = 'config'")[0][0])
    assert ledger_rows(workdir, "SELECT COUNT(*) FROM pushes WHERE state = 'dropped'")[0][0] == 0
    pushes = ledger_rows(workdir, """
        SELECT push_id, worker_id, base_version, steps, tokens, merged_version FROM pushes
        WHERE state = 'merged' ORDER BY merged_version, rowid""")  # fmt: skip
    scales = dict(ledger_rows(workdir, "SELECT version, scale FROM rounds WHERE fragment = 0"))
    shards = {sid: read_shard(uri).rows for sid, uri in ledger_rows(workdir, "SELECT id, uri FROM shards")}
    assert len(scales) >= 5 and len({p[1] for p in pushes}) == 2

    torch.set_num_threads(1)
    vocab, bs = cfg.model.vocab_size, cfg.train.batch_size
    reference = build_model(cfg.model, vocab, cfg.train.seed)
    theta = {n: p.detach().clone() for n, p in reference.named_parameters()}
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    learner_state: dict[str, tuple] = {}
    for version in sorted(scales):
        deltas, tokens, steps = [], [], []
        for push_id, worker, base, n_steps, n_tokens, merged_at in pushes:
            if merged_at != version:
                continue
            assert base == version - 1, "a synchronous push is based on the version before its merge"
            if worker not in learner_state:
                model = build_model(cfg.model, vocab, cfg.train.seed)
                learner_state[worker] = (model, make_inner_optimizer(model, cfg.train), [0])
            model, opt, step = learner_state[worker]
            params = dict(model.named_parameters())
            with torch.no_grad():
                for n, t in theta.items():
                    params[n].copy_(t)
            done = 0
            for sid, a, b in ledger_rows(
                workdir,
                "SELECT shard_id, row_start, row_end FROM spans WHERE push_id = ? ORDER BY rowid",
                (push_id,),
            ):
                for i in range(a, b, bs):
                    batch = torch.from_numpy(shards[sid][i : min(i + bs, b)].astype("int64"))
                    for group_ in opt.param_groups:
                        group_["lr"] = lr_at(step[0], cfg.train)
                    loss = model({"input_ids": batch})
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                    opt.step()
                    step[0] += 1
                    done += 1
            assert done == n_steps, "the rows recorded for a push are exactly the batches it trained on"
            deltas.append({n: theta[n] - params[n].detach() for n in theta})
            tokens.append(n_tokens)
            steps.append(n_steps)
        # The coordinator folds each push into the round's sum as it arrives (two terms: the
        # order does not change a bit) and scales once at the end.
        acc = merging.MergeAccumulator(cfg.sync.merge)
        for d, t, s in zip(deltas, tokens, steps, strict=True):
            acc.add(d, merging.merge_weight(t, s, cfg.sync.merge))
        # A round of short pushes is scaled down too (never a fragment's first merge).
        short = merging.short_push_scale(steps, cfg.train.inner_steps, cfg.sync.short_push_scale)
        grad = acc.result(scales[version] * (short if version > 1 else 1.0))
        # The momentum moves by the round's work: its steps over every live learner's H (the
        # live learners are the round's pushers over its coverage).
        live = round(len(deltas) / scales[version])
        work = merging.work_fraction(sum(steps), live, cfg.train.inner_steps)
        theta, momentum = merging.outer_step(
            theta,
            momentum,
            grad,
            # The merge into version + 1: the outer step's warm-up reads the version it merges onto.
            *merging.outer_hyper(
                cfg.sync.outer_lr, cfg.sync.outer_momentum, cfg.sync.outer_warmup_rounds, version - 1
            ),
            cfg.sync.nesterov,
            work,
        )

    final = load_model_params(store.join(str(workdir.resolve()), "checkpoints"), [max(scales)])
    for name, value in theta.items():
        torch.testing.assert_close(
            final[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
