"""The last merge of each fragment of finished runs, made again with its outer gradient scaled
down: would a partial round's merge have done better at a smaller step?

    python benchmarks/replay_last_merges.py RUN_DIR [RUN_DIR ...] --out replay.json

A run's last merge of a fragment is replayed exactly: nothing trained after it, and its outer
gradient comes back from the two checkpoints around it (m_v = g + μ^f · m_{v−1}; the replay
checks that the outer step on that g gives the stored parameters). Each is made again with g
times √work and times work (work: the round's steps over M·H, as the merger counts it), and the
model's held-out loss at the run's final versions is compared with what the run got. Needs the
versions v−1 and v of each fragment, which every run keeps (coordinator.keep_versions ≥ 2).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.merge_evals import RunModel  # noqa: E402

SCALINGS = {"sqrt(work)": math.sqrt, "work": lambda f: f}


def replay(workdir: Path) -> list[dict[str, Any]]:
    run = RunModel(workdir)
    kept = run.kept()
    last = {fragment: row for fragment, *row in run.rounds()}  # each fragment's last round
    as_merged = run.loss_of(run.final)
    out = []
    for fragment, version in enumerate(run.final):
        if fragment not in last or (fragment, version - 1) not in kept or (fragment, version) not in kept:
            continue
        _, _, pushes, _, steps, _, coverage = last[fragment]
        step = run.merge_step(fragment, version, pushes, steps, coverage)
        if step.error > 1e-4:
            print(
                f"{workdir.name} fragment {fragment}: the replay does not give the stored merge ({step.error:.1e})"
            )
            continue
        losses = {"as merged": as_merged}
        for label, scale in SCALINGS.items():
            params, _ = step.take(step.params, step.momentum, scale(step.work))
            losses[label] = run.loss_of(run.final, params)
        out.append({"run": str(workdir), "fragment": fragment, "version": version, "steps": steps,
                    "work": step.work, "losses": losses})  # fmt: skip
        print(f"{workdir.parent.name}/{workdir.name} fragment {fragment} v{version} steps {steps} work {step.work:.2f}: "
              + " ".join(f"{k} {v:.4f}" for k, v in losses.items()), flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    merges = [m for run in args.runs for m in replay(run)]
    partial = [m for m in merges if m["work"] < 1]
    summary = {}
    for label in SCALINGS:
        change = [m["losses"][label] / m["losses"]["as merged"] - 1 for m in partial]
        if len(change) > 1:
            summary[label] = {"merges": len(change), "mean": statistics.mean(change), "sd": statistics.stdev(change),
                              "worst": max(change), "best": min(change)}  # fmt: skip
            s = summary[label]
            print(f"g × {label} over {s['merges']} partial last merges: loss {s['mean']:+.3%} on average "
                  f"(sd {s['sd']:.3%}, worst {s['worst']:+.3%}, best {s['best']:+.3%})")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"merges": merges, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
