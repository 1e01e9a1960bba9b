"""The simulator against real local chaos runs: calibrated on each run, does it predict its goodput?

    python benchmarks/simulate_check.py --minutes 3                  # every arm (~25 min)
    python benchmarks/simulate_check.py --minutes 1 --arms m2-30     # a smoke test

Arms: M = 2 and 4 learners, learner kills every 30 s and 120 s per learner on average
(`--chaos-roles learner`, a kill every interval / M seconds among them), and one arm with
coordinator kills too (the chaos bag alternates roles: each is hit every 2 x interval). Each arm
is a `diloco run` (benchmarks.chaos.diloco_run); the run's workdir calibrates the simulator
(diloco.simulate.calibrate), which then replays the run as M learners of one chip each:

- predicted (trace): the run's own kill times, its measured restart costs and losses;
- predicted (Poisson): the chaos rate instead of the kill times, mean and sd over seeds.

Measured goodput is the summary's (diloco.local.summary.goodput: learner-seconds of kept inner
steps, times the merged share, over M x wall), and so is the simulator's for this case: stepping
seconds a kill did not lose, times the share of a life spent in steps, over M x wall. The target:
within 5 points. Results go to benchmarks/results/simulate_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import diloco_run, keep_or_temp  # noqa: E402
from benchmarks.goodput import restarts  # noqa: E402
from diloco.simulate import simulate  # noqa: E402
from diloco.simulate.calibrate import read_calibration, replay_config  # noqa: E402

# name: (learners, mean seconds between kills of each learner, coordinator killed too)
ARMS = {
    "m2-30": (2, 30.0, False),
    "m2-120": (2, 120.0, False),
    "m4-30": (4, 30.0, False),
    "m4-120": (4, 120.0, False),
    "m2-120-coord": (2, 120.0, True),
}


def chaos_args(learners: int, per_learner_s: float, coordinator: bool) -> tuple[list[str], float | None]:
    """The `diloco run` chaos flags for an arm, and the coordinator's mean seconds between kills."""
    if coordinator:  # the bag alternates learner and coordinator kills
        interval = per_learner_s / (2 * learners)
        return ["--chaos-interval", str(interval), "--chaos-roles", "coordinator,learner"], 2 * interval
    return ["--chaos-interval", str(per_learner_s / learners), "--chaos-roles", "learner"], None


def check_arm(name: str, summary: dict[str, Any], workdir: Path, seeds: int) -> dict[str, Any]:
    learners, per_learner_s, coordinator = ARMS[name]
    _, coordinator_every = chaos_args(learners, per_learner_s, coordinator)
    cal = read_calibration(workdir)
    traced = simulate(replay_config(cal), "decoupled")
    poisson = [
        simulate(replay_config(cal, seed=s, kill_every_s=per_learner_s, coordinator_every_s=coordinator_every),
                 "decoupled").goodput
        for s in range(seeds)
    ]  # fmt: skip
    measured = float(summary.get("goodput", 0.0))
    return {
        "arm": name,
        "learners": learners,
        "kill_every_s_per_learner": per_learner_s,
        "coordinator_kills": coordinator,
        "kills": summary.get("kills", {}),
        "measured": measured,
        "predicted_trace": round(traced.goodput, 4),
        "error_points": round(100 * (traced.goodput - measured), 2),
        "predicted_poisson_mean": round(statistics.fmean(poisson), 4),
        "predicted_poisson_sd": round(statistics.pstdev(poisson), 4),
        "within_5_points": abs(traced.goodput - measured) <= 0.05,
        "calibration": cal.to_dict(),
        "restart_phases": restarts(workdir),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0, help="wall time of every arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seeds", type=int, default=50, help="Poisson replays per arm")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' workdirs under this folder")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_check.json")
    args = p.parse_args(argv)
    names = [a for a in args.arms.split(",") if a]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}")
    rows = []
    with keep_or_temp(args.keep, "diloco_simcheck_") as tmp:
        for name in names:
            learners, per_learner_s, coordinator = ARMS[name]
            extra, _ = chaos_args(learners, per_learner_s, coordinator)
            common = ["--minutes", str(args.minutes), "--learners", str(learners), "--seed", str(args.seed)]
            for item in args.overrides:
                common += ["--set", item]
            print(f"== {name}", file=sys.stderr, flush=True)
            summary = diloco_run(name, Path(tmp), [*common, *extra], args.minutes * 60 + 600)
            rows.append(check_arm(name, summary, Path(tmp) / name, args.seeds))
            r = rows[-1]
            print(
                f"   measured {r['measured']:.1%}, predicted {r['predicted_trace']:.1%}",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"{'arm':<14}{'kills':>7}{'measured':>10}{'predicted':>11}{'error':>8}{'Poisson':>16}{'<=5 pts':>9}"
    )
    for r in rows:
        poisson = f"{r['predicted_poisson_mean']:.1%}±{r['predicted_poisson_sd']:.1%}"
        print(f"{r['arm']:<14}{sum(r['kills'].values()):>7}{r['measured']:>10.1%}{r['predicted_trace']:>11.1%}"
              f"{r['error_points']:>+7.1f}p{poisson:>16}{str(r['within_5_points']):>9}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n"
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
