"""Your own training loop (diloco.connect), as examples/own-loop/train.py runs it: two learner
processes of user code against a real coordinator and data worker, one of them killed with
SIGKILL and started again (it resumes its local state). Every train token is merged exactly once,
and the global model loaded into the user's own Llama has learned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.compute import local_state
from diloco.compute.local_state import pushed_count, state_path
from diloco.coordinator.checkpoint import load_model_params
from diloco.coordinator.report import stored_run
from diloco.data.shard import read_shard
from diloco.local.procs import ProcessGroup
from tests.support import REPO, ledger_rows, run_cli, start_coordinator, wait_for

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "examples/own-loop/train.py"


@pytest.mark.timeout(300)
def test_the_own_loop_example_resumes_after_kill_9_and_trains_every_token_exactly_once(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    scripts: list[subprocess.Popen] = []
    try:
        address = start_coordinator(
            group, workdir,
            ["--dataset", str(tiny_corpus), "--set", "data.chunk_bytes=32768", "--set", "train.inner_steps=20",
             "--set", "sync.overlap_steps=4", "--set", "data.eval_fraction=0.1",
             "--set", "train.local_state_every_s=0.2"],
        )  # fmt: skip
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        state_dir = tmp_path / "own-state"

        def start(i: int, log: Path) -> subprocess.Popen:
            with open(log, "wb") as out:
                return subprocess.Popen(
                    [sys.executable, str(SCRIPT), "--coordinator", address, "--worker-id", f"own-{i}",
                     "--state-dir", str(state_dir)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                    env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                )  # fmt: skip

        logs = [tmp_path / f"own-{i}.log" for i in range(2)]
        scripts += [start(i, log) for i, log in enumerate(logs)]

        # kill -9 of one user's script mid-run; started again with the same id, it resumes the
        # state diloco kept on local disk for it. A kill between a push and the next copy of the
        # state cannot resume (that push's work would be merged twice): the restart says so and
        # starts from the global model, and the test kills that life again.
        path = state_path(state_dir, "own-1")

        def kept() -> local_state.LocalState | None:
            return local_state.load(path, [[]] * 8) if path.exists() else None

        def resumable(state: local_state.LocalState | None) -> bool:
            return state is not None and state.inner_steps >= 10 and state.push_count == pushed_count(path)

        for life in range(2, 6):
            wait_for(
                lambda: resumable(kept()), 150, "own-1 to keep its state past step 10, with its last push"
            )
            scripts[-1].kill()
            scripts[-1].wait(10)
            state = kept()
            will_resume = resumable(state)  # the kill may have fallen after a push
            logs.append(tmp_path / f"own-1-life-{life}.log")
            scripts.append(start(1, logs[-1]))
            if will_resume:
                break
            wait_for(lambda: "started from the global model" in logs[-1].read_text(), 60, "the reason")
        else:
            pytest.fail("four kills of own-1 in a row fell between a push and its state copy")
        assert state is not None
        saved = state.inner_steps
        killed = {log.name for log in logs[1:-1]}
        for proc, log in zip(scripts, logs, strict=True):
            if log.name not in killed:
                assert proc.wait(timeout=220) == 0, log.read_text()[-3000:]
        outputs = [log.read_text() for log in (logs[0], logs[-1])]
        assert all("done after" in out and "Traceback" not in out for out in outputs), outputs
        resumed = [line for line in outputs[1].splitlines() if "own-1 resumed at step" in line]
        assert resumed and int(resumed[0].split("step ")[1]) >= saved, outputs[1][-3000:]
        assert not path.exists(), "a clean end leaves nothing to resume"
        audit = run_cli(["status", "--workdir", str(workdir), "--audit"], timeout=60)
        assert audit.returncode == 0, audit.stdout + audit.stderr

        train_tokens = ledger_rows(workdir, "SELECT SUM(tokens) FROM shards WHERE split = 'train'")[0][0]
        merged = ledger_rows(workdir, "SELECT value FROM counters WHERE name = 'tokens_merged'")[0][0]
        pushed_by = dict(
            ledger_rows(
                workdir, "SELECT worker_id, COUNT(*) FROM pushes WHERE state = 'merged' GROUP BY worker_id"
            )
        )
        assert set(pushed_by) == {"own-0", "own-1"}, pushed_by
        assert int(merged) == train_tokens  # every train token merged, and none twice (the audit)

        # The global model, in the user's own class: it learned.
        _, versions = stored_run(workdir)
        params = load_model_params(str(workdir / "checkpoints"), versions)
        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=129)
        )  # fmt: skip
        model.load_state_dict(params)
        eval_uris = ledger_rows(workdir, "SELECT uri, checksum FROM shards WHERE split = 'eval'")
        rows = np.concatenate([read_shard(uri, checksum).rows for uri, checksum in eval_uris])[:64]
        ids = torch.from_numpy(rows.astype(np.int64))
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        assert loss < np.log(257) - 2.0, loss  # a uniform guess is log(257) = 5.55
    finally:
        for proc in scripts:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        group.stop()
