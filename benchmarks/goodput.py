"""Goodput under learner failures: M learners, only learners killed, next to the fault-free run.

    python benchmarks/goodput.py --learners 4 --minutes 3 --per-learner 120,30 --seed 1
    python benchmarks/goodput.py --learners 2 --learner-ranks 2 --minutes 2 --per-learner 30   # torchrun groups

Goodput is the share of learner-seconds whose work was merged (run.goodput): time in inner steps
over every life of every learner, times the share of trained tokens that merged, over M × wall
time. On shared cores merged tokens per second alone would hide a kill's cost, since a dead
learner's core goes to the others. Each arm is a `diloco run` of the same seed and wall time;
`--chaos-roles learner` SIGKILLs a learner every (per-learner interval / M) seconds on average and
restarts it. Printed per arm: goodput, merged and trained tokens/s, kills, eval loss; and, from the
restarted learners' own start-up lines (diloco.compute.startup), the time from a kill's respawn to
the first inner step, phase by phase (mean and worst over restarts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import diloco_run  # noqa: E402
from diloco.compute.startup import PHASES, read_startups  # noqa: E402


def restarts(workdir: Path) -> list[dict[str, float]]:
    """The start-up phases of every learner life after the first (the restarts after a kill)."""
    return [
        life.phases
        for log in sorted((workdir / "logs").glob("learner-*.log"))
        for life in read_startups(log.read_text(errors="replace"))[1:]
    ]


def resumes(workdir: Path) -> tuple[int, int]:
    """(restarts that resumed from their local state, restarts that started fresh)."""
    resumed = fresh = 0
    for log in (workdir / "logs").glob("learner-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "local state: " in line:
                resumed += "resuming at step" in line
                fresh += "resuming at step" not in line
    return resumed, fresh


def arm_row(
    name: str, summary: dict[str, Any], lives: list[dict[str, float]], resumed: tuple[int, int]
) -> dict[str, Any]:
    wall = max(1e-9, summary["wall_seconds"])
    by_phase = {
        phase: {"mean": statistics.fmean(v), "max": max(v)}
        for phase in (*PHASES, "total")
        if (v := [life[phase] for life in lives if phase in life])
    }
    return {
        "arm": name,
        "goodput": summary.get("goodput", 0.0),
        "goodput_after_start": summary.get("goodput_after_start", 0.0),
        "job_startup_s": summary.get("job_startup_seconds", 0.0),
        "resumed_from_local_state": resumed[0],
        "restarted_fresh": resumed[1],
        "merged_tokens_per_s": summary["tokens_merged"] / wall,
        "trained_tokens_per_s": summary["tokens_trained"] / wall,
        "merged_share": summary["tokens_merged"] / max(1, summary["tokens_trained"]),
        "kills": sum(summary.get("kills", {}).values()),
        "eval_loss": summary.get("eval_loss"),
        "tokens_merged": summary["tokens_merged"],
        "audit_ok": summary.get("audit_ok"),
        "restart_phases_s": by_phase,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--minutes", type=float, default=3.0, help="wall time of every arm")
    p.add_argument("--per-learner", default="120,30", help="mean seconds between kills of each learner")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--learner-ranks", type=int, default=1, help="each learner a torchrun group of N ranks")
    p.add_argument("--data-parallel", default="ddp", help="inside a group: ddp or fsdp")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "goodput.json")
    args = p.parse_args(argv)

    common = ["--minutes", str(args.minutes), "--learners", str(args.learners), "--seed", str(args.seed),
              "--learner-ranks", str(args.learner_ranks), "--data-parallel", args.data_parallel]  # fmt: skip
    for item in args.overrides:
        common += ["--set", item]
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco_goodput_") as tmp:
        arms = [("fault-free", [])] + [
            (f"kill every {s}s per learner",
             ["--chaos-interval", str(float(s) / args.learners), "--chaos-roles", "learner"])
            for s in args.per_learner.split(",")
        ]  # fmt: skip
        for i, (name, extra) in enumerate(arms):
            print(f"== {name}", file=sys.stderr, flush=True)
            summary = diloco_run(f"arm{i}", Path(tmp), [*common, *extra], args.minutes * 60 + 600)
            workdir = Path(tmp) / f"arm{i}"
            rows.append(arm_row(name, summary, restarts(workdir), resumes(workdir)))

    calm = rows[0]
    print(f"{'arm':<30}{'goodput':>9}{'vs calm':>9}{'after start':>12}{'vs calm':>9}{'merged/s':>10}"
          f"{'trained/s':>11}{'merged':>8}{'kills':>7}{'resumed':>9}{'eval':>8}")  # fmt: skip
    for r in rows:
        after, calm_after = r["goodput_after_start"], max(1e-9, calm["goodput_after_start"])
        print(f"{r['arm']:<30}{r['goodput']:>9.1%}{r['goodput'] / max(1e-9, calm['goodput']):>9.1%}"
              f"{after:>12.1%}{after / calm_after:>9.1%}"
              f"{r['merged_tokens_per_s']:>10.0f}{r['trained_tokens_per_s']:>11.0f}{r['merged_share']:>8.1%}"
              f"{r['kills']:>7}{r['resumed_from_local_state']:>5}/{r['kills']:<3}"
              f"{r['eval_loss'] or float('nan'):>8.4f}")  # fmt: skip
    for r in rows[1:]:
        phases = r["restart_phases_s"]
        if phases:
            line = ", ".join(f"{k} {v['mean']:.2f}s (worst {v['max']:.2f})" for k, v in phases.items())
            print(f"{r['arm']}: kill → first step: {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}},
                                   indent=2) + "\n")  # fmt: skip
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
