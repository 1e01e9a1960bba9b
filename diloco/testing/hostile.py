"""A run with a broken or hostile learner among honest ones, every role a real process on loopback:
`diloco coordinator`, a `diloco data` worker, honest `diloco compute` learners, and learners that
climb the loss (diloco.testing.ascent_learner: user code through diloco.connect, a valid identity,
finite deltas of about the honest ones' size). What the coordinator made of it (who it named and
when, whose pushes it refused or clipped), whether every merged token was merged once (the audit),
and the global model's held-out loss. Used by tests/e2e/test_hostile_learner.py and
benchmarks/hostile_learner.py.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.coordinator.audit import audit
from diloco.coordinator.ledger import ledger_path
from diloco.coordinator.pusher_watch import SUSPECT_REFUSAL
from diloco.local.procs import ProcessGroup

# The run both use: a one-layer GPT resting between steps, so three learners and a data worker
# share two cores at about the default model's pace; two fragments, H = 20.
BASE = (
    "data.chunk_bytes=65536", "train.inner_steps=20", "sync.overlap_steps=4", "sync.fragments=2",
    "train.threads=1", "train.batch_size=8", "model.kwargs.n_layer=1", "train.step_delay_s=0.1",
    "data.eval_fraction=0.1",
)  # fmt: skip
NAMED = re.compile(r"learner (\S+) looks hostile or broken: (.*)")
UNNAMED = re.compile(r"learner (\S+) no longer looks hostile or broken")
ASCENT_ID = re.compile(r"ascent learner (\S+) joined")


@dataclass(frozen=True, kw_only=True)
class HostileRun:
    honest: int = 2  # honest learners
    ascent: int = 1  # learners climbing the loss (0: the honest reference)
    lr_scale: float = 1.0  # the climbers' learning rate over the run's
    lie: bool = False  # the climbers report the lowest loss they have seen (ascent_learner --lie)
    tokens: int = 700_000  # the run's merged-token budget
    seed: int = 1  # train.seed: the model's init
    overrides: tuple[str, ...] = ()  # section.key=value, after BASE
    timeout_s: float = 240.0


def run(workdir: Path, dataset: Path, spec: HostileRun) -> dict[str, Any]:
    """Run `spec` in `workdir` (its processes' logs under workdir/logs) and say what happened."""
    settings = [*BASE, f"train.max_tokens={spec.tokens}", f"train.seed={spec.seed}", *spec.overrides]
    group = ProcessGroup(workdir / "logs", fork=True)
    climbers: list[subprocess.Popen] = []
    logs = [workdir / "logs" / f"ascent-{i}.log" for i in range(spec.ascent)]
    started = time.monotonic()
    try:
        coordinator = group.spawn(
            "coordinator", "coordinator",
            ["coordinator", "--workdir", str(workdir), "--port", "0", "--dataset", str(dataset),
             *(a for s in settings for a in ("--set", s))],
        )  # fmt: skip
        address = _address(workdir, coordinator, group, started + 60)
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        honest = [
            group.spawn(f"learner-{i}", "learner", ["compute", "--coordinator", address, "--threads", "1"])
            for i in range(spec.honest)
        ]
        for log in logs:
            with open(log, "wb") as out:
                climbers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "diloco.testing.ascent_learner", "--coordinator", address,
                         "--lr-scale", str(spec.lr_scale), "--step-delay", "0.1", *(["--lie"] if spec.lie else [])],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                    )
                )  # fmt: skip
        ended = group.wait(honest, timeout_s=max(1.0, started + spec.timeout_s - time.monotonic()))
        codes = [c.proc.returncode for c in honest]
        for proc in climbers:
            proc.wait(timeout=max(1.0, started + spec.timeout_s + 60 - time.monotonic()))
    finally:
        for proc in climbers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        group.stop()
    wall_s = time.monotonic() - started
    if not ended or any(codes) or any(p.returncode for p in climbers):
        tails = [group.tail(c) for c in honest] + [log.read_text(errors="replace")[-2000:] for log in logs]
        raise RuntimeError(f"the run did not end cleanly (honest exits {codes}):\n" + "\n".join(tails))
    ascent_ids = [_ascent_id(log) for log in logs]
    return {"wall_s": round(wall_s, 1), "ascent_ids": ascent_ids, **_outcome(workdir, ascent_ids)}


def _address(workdir: Path, coordinator: Any, group: ProcessGroup, deadline: float) -> str:
    info = workdir / "coordinator.json"
    while not info.exists():
        if time.monotonic() > deadline or not coordinator.alive:
            raise RuntimeError("the coordinator did not start:\n" + group.tail(coordinator))
        time.sleep(0.1)
    return json.loads(info.read_text())["address"]


def _ascent_id(log: Path) -> str:
    found = ASCENT_ID.search(log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{log.name}: the climbing learner never joined")
    return found.group(1)


def _outcome(workdir: Path, ascent_ids: list[str]) -> dict[str, Any]:
    """From the run's ledger and coordinator log: each learner's pushes (merged, refused while
    named, before its first naming), who was named and why (and how often un-named), the audit,
    the held-out loss."""
    from diloco.results import evaluate_loaded, load_model

    with sqlite3.connect(f"file:{ledger_path(workdir)}?mode=ro", uri=True) as db:
        pushes = db.execute(
            "SELECT worker_id, state, reason, received FROM pushes ORDER BY received"
        ).fetchall()
        counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
    coordinator_log = (workdir / "logs" / "coordinator.log").read_text(errors="replace")
    named: dict[str, str] = {}
    for worker, why in NAMED.findall(coordinator_log):
        named.setdefault(worker, why)
    learners: dict[str, dict[str, int]] = {}
    first_refused: dict[str, int] = {}
    for worker, state, reason, _ in pushes:
        mine = learners.setdefault(
            worker,
            {"merged": 0, "merged_after_refused": 0, "refused_named": 0, "other_dropped": 0, "unnamed": 0},
        )
        if state == "merged":
            mine["merged"] += 1
            mine["merged_after_refused"] += worker in first_refused  # named, then no longer
        elif (reason or "").startswith(SUSPECT_REFUSAL):
            first_refused.setdefault(worker, mine["merged"] + mine["refused_named"] + mine["other_dropped"])
            mine["refused_named"] += 1
        else:
            mine["other_dropped"] += 1
    for worker, n in first_refused.items():
        learners[worker]["pushes_before_refused"] = n
    for worker in UNNAMED.findall(coordinator_log):  # named, then judged to look like the others
        if worker in learners:
            learners[worker]["unnamed"] += 1
    report = audit(workdir)
    evaluated = evaluate_loaded(load_model(workdir, None), None, None)
    return {
        "named": named,
        "honest_named": sorted(set(named) - set(ascent_ids)),
        "learners": learners,
        "tokens_merged": int(counters.get("tokens_merged", 0)),
        "pushes_center_clipped": int(counters.get("pushes_center_clipped", 0)),
        "audit_ok": report.ok,
        "audit_violations": report.violations[:5],
        "eval_loss": evaluated["loss"],
        "baseline_loss": evaluated.get("baseline_loss"),
    }
