"""A small `diloco run` workdir shaped like a real one: summary.json, learner and coordinator
logs with start-up, resume and end lines, and metrics.jsonl."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

T0 = datetime(2026, 1, 1, 12, 0, 0).timestamp()


def stamp(seconds: float) -> str:
    """A log line's time as diloco.logs writes it, `seconds` after T0."""
    return datetime.fromtimestamp(T0 + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def startup(at: float, pid: int, total: float, pull: float = 0.2) -> str:
    rest = total - pull - 0.6
    return (f"{stamp(at)} INFO learner[{pid}] diloco.learner: start-up: process 0.00s, imports {rest:.2f}s, "
            f"join 0.10s, model 0.10s, pull {pull:.2f}s, first batch 0.10s, first step 0.30s (total {total:.2f}s)")  # fmt: skip


def done(at: float, pid: int, busy: float, wall: float, steps: int) -> str:
    return (f"{stamp(at)} INFO learner[{pid}] diloco.learner: learner done (run finishing): steps={steps} "
            f"tokens=1000 busy={busy:.1f}s wall={wall:.1f}s data stall=0.0s sync wait=0.1s refused=0")  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two learners from T0 + 10 s; learner-0 killed at 41 s (its state 1.5 s old when it resumed
    0.5 s later: 1 s lost), back at 43 s; the coordinator killed at 60 s, serving at 62.5 s."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    summary = {
        "learners": 2, "wall_seconds": 100.0, "goodput": 0.85, "goodput_after_start": 0.94,
        "job_startup_seconds": 10.0, "params": 1000, "kills": {"learner": 1, "coordinator": 1},
        "tokens_trained": 10000, "tokens_merged": 9000,
        "config": {"train": {"inner_steps": 50, "local_state_every_s": 2.0},
                   "sync": {"fragments": 2, "overlap_steps": 10, "quorum": 1, "codec": "fp32"}},
        "wire_bytes_by_rpc": {"push": {"received": 4000, "sent": 10, "calls": 2},
                              "pull": {"received": 10, "sent": 4000, "calls": 2}},
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "logs" / "learner-0.log").write_text("\n".join([
        startup(10.0, 11, total=6.0),
        f"{stamp(41.5)} INFO learner[12] diloco.learner: local state: resuming at step 100 from state 1.5s old (versions [1, 0], run at [1, 0])",
        startup(43.0, 12, total=2.0),
        done(98.0, 12, busy=54.0, wall=55.5, steps=200),
    ]) + "\n")  # fmt: skip
    (run / "logs" / "learner-1.log").write_text("\n".join([
        startup(10.0, 13, total=6.0), done(98.0, 13, busy=87.0, wall=94.0, steps=300),
    ]) + "\n")  # fmt: skip
    (run / "logs" / "coordinator.log").write_text("\n".join([
        f"{stamp(0.0)} INFO coordinator[100] diloco.coordinator: coordinator listening on 127.0.0.1:1 epoch=1",
        f"{stamp(30.0)} INFO coordinator[100] diloco.coordinator: merge fragment=0 version=1 pushes=2 tokens=10 loss=2.0 (every live learner pushed) in 0.010s",
        f"{stamp(60.0)} INFO coordinator[100] diloco.coordinator: heartbeat worker=learner-1",
        f"{stamp(61.0)} INFO coordinator[200] diloco.coordinator: recovered the ledger",
        f"{stamp(61.5)} INFO coordinator[200] diloco.coordinator: coordinator listening on 127.0.0.1:1 epoch=2",
        f"{stamp(80.0)} INFO coordinator[200] diloco.coordinator: merge fragment=1 version=1 pushes=2 tokens=10 loss=2.0 (every live learner pushed) in 0.030s",
    ]) + "\n")  # fmt: skip
    events = [{"kind": "start", "at": T0, "epoch": 1}, {"kind": "join", "at": T0 + 5, "role": "compute"},
              {"kind": "start", "at": T0 + 62.5, "epoch": 2}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run
