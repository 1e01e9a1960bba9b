"""End to end, with real processes on loopback: coordinator, data workers, learners.

These prove the promises a user relies on: a run trains (its eval loss falls far below the first
step's), every chunk becomes exactly one recorded shard, and every train token is merged exactly
once when the learners run the data out.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.checkpoint import load_model_params
from diloco.data.shard import read_shard
from diloco.evaluate import evaluate
from diloco.local.procs import ProcessGroup
from diloco.model.factory import build_model
from diloco.v1 import coordinator_pb2 as pb
from tests.support import QUICK_END, REPO, ledger_rows, run_cli, start_coordinator, wait_for

pytestmark = pytest.mark.e2e


def assert_one_shard_per_chunk(workdir: Path) -> None:
    pairs = ledger_rows(
        workdir,
        "SELECT c.id, c.state, COUNT(s.id) FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id",
    )
    assert pairs, "the ledger has no chunks"
    bad = [(cid, state, n) for cid, state, n in pairs if state != "done" or n != 1]
    assert not bad, f"chunks without exactly one recorded shard: {bad[:5]}"
    files = sorted(p.name for p in (workdir / "shards").glob("*.shard"))
    assert len(files) == len(pairs), f"{len(files)} shard files for {len(pairs)} chunks"
    assert not list((workdir / "shards").glob("*.tmp-*")), "temporary shard files were left behind"


@pytest.mark.timeout(500)
def test_local_run_trains_and_records_one_shard_per_chunk(small_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    args = [
        "run",
        "--dataset",
        str(small_corpus),
        # A token budget, not a wall time: the same work however busy the suite keeps the
        # cores (200k tokens: eval ~2.68 against the unigram's 3.11, 20 s on a quiet machine).
        "--tokens",
        "200000",
        "--minutes",
        "3",
        "--learners",
        "2",
        "--data-workers",
        "2",
        "--workdir",
        str(workdir),
        "--inner-steps",
        "20",
        "--seed",
        "7",
        "--no-progress",
        "--set",
        "data.chunk_bytes=131072",
        # Every chunk becomes one shard (asserted below), not only the few ahead of the
        # learners that `diloco run` makes by default.
        "--set",
        "data.max_ready_shards=1000000",
        # 16 batches are enough to tell the model from the unigram baseline; the sample stays.
        "--set",
        "eval.final_batches=16",
    ]
    result = run_cli(args, timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = json.loads((workdir / "summary.json").read_text())
    assert str(workdir / "summary.json") in result.stdout + result.stderr

    for key in (
        "eval_loss",
        "baseline_loss",
        "tokens_trained",
        "rounds",
        "chunks",
        "shards",
        "wire_bytes",
        "wall_seconds",
    ):
        assert key in summary, key
    # Training worked: from ~ln(257) = 5.55 at the first step to far below it, and below the
    # best context-free predictor of the same held-out data.
    assert summary["first_loss"] > 5.0
    assert summary["eval_loss"] < summary["first_loss"] - 2.0, summary
    assert summary["eval_loss"] < summary["baseline_loss"], summary
    assert summary["rounds"] >= 2
    assert 0 < summary["tokens_merged"] <= summary["tokens_trained"]
    assert summary["wire_bytes"] > 0
    # The learners timed their pulls' arrival (at least the join's full pull).
    assert summary["transfers"]["learner_pull_seconds_mean"] > 0, summary["transfers"]
    # The learners' speed per wall second and per CPU-second of their own processes, both known.
    assert summary["learner_tokens_per_s"] > 0 and summary["learner_tokens_per_cpu_s"] > 0, summary
    assert summary["sample"].startswith("def ")
    assert summary["chunks"] == summary["shards"] > 1
    assert_one_shard_per_chunk(workdir)
    # Every key the summary holds is documented in the README's list.
    readme = (REPO / "README.md").read_text()
    documented = readme[
        readme.index("`summary.json` keys (stable") : readme.index("## How the syncer decides")
    ]
    undocumented = [key for key in summary if f"`{key}`" not in documented]
    assert not undocumented, f"summary keys missing from the README: {undocumented}"

    # The trained model is left in one file, and a new run can start from it (a warm start).
    assert summary["model"] == str(workdir / "model.safetensors")
    warm = tmp_path / "warm"
    result = run_cli(
        ["run", "--dataset", str(small_corpus), "--tokens", "20000", "--learners", "1",
         "--data-workers", "1", "--workdir", str(warm), "--no-progress", "--set", "data.chunk_bytes=131072",
         "--set", f"model.init_from={summary['model']}", *QUICK_END],
        timeout=240,  # on cores shared with the suite's other multi-process tests
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    warm_summary = json.loads((warm / "summary.json").read_text())
    # Its very first step is already near where the first run ended, not at ln(257).
    assert warm_summary["first_loss"] < summary["eval_loss"] + 0.5, (warm_summary, summary["eval_loss"])
    # Its end as asked (QUICK_END): 4 batches evaluated, no sample.
    train, model = warm_summary["config"]["train"], warm_summary["config"]["model"]
    assert warm_summary["eval_tokens"] == 4 * train["batch_size"] * (model["seq_len"] + 1), warm_summary
    assert warm_summary["sample"] == "" and summary["eval_tokens"] > warm_summary["eval_tokens"]

    # The finished run's workdir given again: refused before anything starts (the ledger says the
    # run finished), naming the model to start a new run from; nothing in the workdir changes.
    before = (workdir / "summary.json").read_text()
    again = run_cli(args, timeout=60)
    assert again.returncode == 2, (again.stdout[-2000:], again.stderr[-3000:])
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {workdir} holds a finished run"), lines
    assert f"model.init_from={workdir / 'model.safetensors'}" in lines[0], lines
    assert (workdir / "summary.json").read_text() == before


@pytest.mark.timeout(240)
def test_roles_run_by_hand_train_every_token_exactly_once(tiny_corpus: Path, tmp_path: Path) -> None:
    """The three roles started as a user would on separate machines; learners run the data out."""
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(
            group,
            workdir,
            [
                "--dataset",
                str(tiny_corpus),
                "--set",
                "data.chunk_bytes=32768",
                "--set",
                "train.inner_steps=10",
                "--set",
                "sync.overlap_steps=3",
                "--set",
                "train.threads=1",
                # One layer: the learners run the data out and the evaluator (every second)
                # follows them; what is checked is the accounting, not the arithmetic.
                "--set",
                "model.kwargs.n_layer=1",
            ],
        )
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        for i in range(2):
            group.spawn(f"learner-{i}", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        evaluator = group.spawn(
            "evaluator", "evaluator", ["evaluator", "--coordinator", address, "--every", "1"]
        )
        workers = group.by_role("data") + group.by_role("learner")
        assert group.wait(workers, timeout_s=180), "workers did not finish: " + group.tail(workers[-1])
        assert [c.proc.returncode for c in workers] == [0, 0, 0], [group.tail(c) for c in workers]
        # Finished, the run's final model is evaluated once more, and the evaluator leaves.
        with contextlib.closing(CoordinatorClient(address, pb.ROLE_OBSERVER)) as observer:
            cfg = RunConfig.from_json(observer.join().config_json)
            observer.finish("the data ran out")
        assert group.wait([evaluator], timeout_s=60), group.tail(evaluator)
        assert evaluator.proc.returncode == 0, group.tail(evaluator)

        status = run_cli(["status", "--coordinator", address, "--json"], timeout=30)
        assert status.returncode == 0, status.stderr
        detail = json.loads(status.stdout)
        train_tokens = ledger_rows(workdir, "SELECT SUM(tokens) FROM shards WHERE split = 'train'")[0][0]
        # Every train token was merged, and none twice.
        assert detail["tokens_merged"] == train_tokens
        assert (
            detail["shards_consumed"]
            == ledger_rows(workdir, "SELECT COUNT(*) FROM shards WHERE split='train'")[0][0]
        )
        merged_spans = ledger_rows(
            workdir,
            """
            SELECT s.shard_id, s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id
            WHERE p.state = 'merged' ORDER BY s.shard_id, s.row_start""",
        )
        for (sid_a, _, end_a), (sid_b, start_b, _) in zip(merged_spans, merged_spans[1:], strict=False):
            assert sid_a != sid_b or end_a <= start_b, "a row was merged twice"
        assert detail["rounds"] >= 2
        assert sum(detail["fragment_versions"]) == detail["rounds"]
        assert_one_shard_per_chunk(workdir)
        assert_final_model_evaluated(detail, workdir, cfg)
        shown = run_cli(["status", "--coordinator", address], timeout=30)
        eval_row = next(line for line in shown.stdout.splitlines() if "held-out eval" in line)
        assert f"{detail['evals'][-1]['loss']:.4f}" in eval_row, shown.stdout
        assert sum("learner" in line and "learner-" in line for line in shown.stdout.splitlines()) == 2

        coordinator = group.by_role("coordinator")[0]
        group.stop([coordinator], grace_s=15)
        assert coordinator.proc.returncode == 0
    finally:
        group.stop()


def assert_final_model_evaluated(detail: dict, workdir: Path, cfg: RunConfig) -> None:
    """The evaluator's last report is the final global model's loss on the first held-out rows,
    the same number as evaluating the final checkpoint here; its pulls are not the learners'."""
    evals = detail["evals"]
    assert evals and all(math.isfinite(e["loss"]) for e in evals), evals
    last = evals[-1]
    assert last["fragment_versions"] == detail["fragment_versions"]
    rows = cfg.eval.max_batches * cfg.train.batch_size
    shards = [read_shard(s["uri"], s["checksum"]) for s in detail["eval_split"]["shards"]]
    ids = np.concatenate([s.columns["input_ids"] for s in shards])[:rows]
    model = build_model(cfg.model, 257, cfg.train.seed)
    params = load_model_params(str(workdir / "checkpoints"), detail["fragment_versions"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    expected = evaluate(model, {"input_ids": ids}, cfg.train.batch_size, "cpu")
    assert last["rows"] == expected.rows == len(ids)
    assert last["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert detail["wire_by_rpc"]["eval_pull"]["sent"] > 0
    assert detail["wire_by_role"]["evaluator"]["sent"] >= detail["wire_by_rpc"]["eval_pull"]["sent"]


def processes_holding_files_under(directory: Path) -> list[int]:
    """PIDs with a file under `directory` open (read from /proc): every process of a job holds its
    log there (stdout and stderr), the fork server too. A command line would not tell: a process
    forked by the fork server has the server's (`python -m diloco.local.forkserver`)."""
    root, pids = f"{directory.resolve()}/", []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(t.startswith(root) for t in targets):
            pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_child(tiny_corpus: Path, tmp_path: Path) -> None:
    """Ctrl-C mid-training: every worker stops cleanly (last heartbeat, leave, exit 0) within
    seconds, while the coordinator still answers; then the coordinator; nothing survives."""
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "run", "--dataset", str(tiny_corpus), "--workdir", str(workdir),
         "--minutes", "5", "--no-progress", "--set", "train.threads=1",
         # Slow steps: the learners are still training when Ctrl-C comes.
         "--set", "train.step_delay_s=0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    logs = workdir / "logs"
    try:

        def training() -> bool:  # (or the job ended: no point waiting)
            started = [f"learner learner-{i} on " in read_log(logs / f"learner-{i}.log") for i in range(2)]
            return proc.poll() is not None or all(started)

        wait_for(training, 60, "both learners training")
        assert proc.poll() is None, "the job ended before Ctrl-C"
        # What the last check looks for is there while the job runs: coordinator, data worker,
        # learners, evaluator and the fork server, each holding its log.
        assert len(processes_holding_files_under(workdir)) >= 5
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - interrupted
        assert proc.returncode == 130, err[-2000:]
        assert "Traceback" not in err
        assert "the same command (the same --workdir) resumes it" in err, err[-2000:]
        # ProcessGroup.stop warns of any child it had to kill or that exited non-zero on SIGTERM.
        assert "warning:" not in err, err[-2000:]
        assert stopped_in < 10, f"the job took {stopped_in:.1f}s to stop"
        coordinator_log = read_log(logs / "coordinator.log")
        for i in range(2):
            assert "learner done (stopped)" in read_log(logs / f"learner-{i}.log"), (
                f"learner-{i} was cut short"
            )
            assert f"leave worker=learner-{i} " in coordinator_log, f"learner-{i} did not leave"
        assert processes_holding_files_under(workdir) == [], "processes of the job outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_children_of_run(workdir)


def kill_children_of_run(workdir: Path) -> None:
    """A failed test leaves nothing running: the job's children have sessions of their own, so
    killing the job does not stop them."""
    for pid in processes_holding_files_under(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.timeout(120)
def test_a_learner_stops_at_once_when_its_coordinator_is_gone(tiny_corpus: Path, tmp_path: Path) -> None:
    """SIGTERM after the coordinator died: the last heartbeat and leave are tried once, not retried
    for the whole outage tolerance, and the learner exits 0."""
    import signal

    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(
            group, workdir,
            ["--dataset", str(tiny_corpus), "--set", "train.threads=1", "--set", "train.step_delay_s=0.05"],
        )  # fmt: skip
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        learner = group.spawn("learner-0", "learner", ["compute", "--coordinator", address, "--threads", "1"])
        wait_for(lambda: "learner learner-" in read_log(learner.log_path), 60, "the learner training")
        coordinator = group.by_role("coordinator")[0]
        group.signal(coordinator, signal.SIGKILL)
        coordinator.proc.wait(timeout=10)
        group.signal(learner, signal.SIGTERM)
        assert group.wait([learner], 20), "the learner kept retrying its last calls: " + group.tail(learner)
        assert learner.proc.returncode == 0, group.tail(learner)
        assert "learner done (stopped)" in read_log(learner.log_path)
    finally:
        group.stop()


@pytest.mark.timeout(180)
def test_a_run_without_held_out_data_says_so(tiny_corpus: Path, tmp_path: Path) -> None:
    """One file, one chunk: nothing can be held out, and the run says so instead of a silent `-`."""
    dataset = tmp_path / "one.txt"
    dataset.write_text(next(tiny_corpus.iterdir()).read_text())
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--dataset", str(dataset), "--workdir", str(workdir), "--learners", "1", "--data-workers", "1",
         "--minutes", "1", "--no-progress", "--inner-steps", "10", "--overlap", "2", "--set", "train.threads=1",
         *QUICK_END],
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "no held-out split" in line]
    assert len(warnings) == 1 and "eval_loss" in warnings[0], result.stderr[-3000:]
    assert json.loads((workdir / "summary.json").read_text())["eval_loss"] is None


@pytest.mark.timeout(180)
def test_prepare_first_starts_the_learners_once_every_chunk_is_a_shard(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """--prepare-first: no learner joins before the data workers made the whole dataset into shards
    (not only the few ahead that `diloco run` keeps by default), and the run then trains as usual."""
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--dataset", str(tiny_corpus), "--workdir", str(workdir), "--learners", "1", "--data-workers", "2",
         "--tokens", "20000", "--prepare-first", "--no-progress", "--inner-steps", "10", "--set", "train.threads=1",
         "--set", "data.chunk_bytes=32768", "--set", "model.kwargs.n_layer=1", *QUICK_END],
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data prepared" in result.stderr, result.stderr[-3000:]
    assert_one_shard_per_chunk(workdir)
    ((last_shard,),) = ledger_rows(workdir, "SELECT MAX(created) FROM shards")
    ((first_learner,),) = ledger_rows(workdir, "SELECT MIN(joined) FROM workers WHERE role = 'compute'")
    assert first_learner >= last_shard, (first_learner, last_shard)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["tokens_merged"] >= 20000 and summary["audit_ok"], summary
