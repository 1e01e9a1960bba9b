"""How close a run's honest pushes came to the outlier bar, read back from its ledger.

    diloco run --workdir runs/a --learners 4 --set train.inner_steps=10 --tokens 600000
    python benchmarks/norm_ratios.py runs/a [runs/b ...] [--show 3] [--out FILE.json]

For every push with tensors, in the order the coordinator received them, its norm per H steps
over the reference the outlier check compared it with (`limits.norm_reference`: the median of
the fragment's last accepted norms of deltas of H steps or more, other workers' where they are
enough), replayed from the ledger's pushes (H from the workdir's run.toml). Printed per run: how many had a reference, the ratio's median, 90th and 99th
percentile and largest, and how many were above 1.5, 2, 3, 5 and 10 (the default
`sync.max_delta_norm_ratio`); `--show R` lists the pushes above R (when, which fragment, whose,
on which version). `--of deviation` does the same for each taken push's deviation from the
fragment's mean step (`sync.center_clip`'s figure, kept in the ledger since it came). Read this before lowering the bar: a push above it is refused, and in a
warm-up every round's deltas are larger than the last.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.config import RunConfig  # noqa: E402
from diloco.coordinator.limits import norm_reference  # noqa: E402
from diloco.coordinator.service.state import NORM_HISTORY  # noqa: E402

BARS = (1.5, 2.0, 3.0, 5.0, 10.0)


def push_ratios(ledger: Path, inner_steps: int, of: str = "norm") -> list[dict[str, Any]]:
    """Each push with a norm (or with `of` "deviation", a deviation from the fragment's mean step:
    sync.center_clip's figure) and a reference: its ratio, fragment, worker, base version and
    seconds since the run's first push. Like the coordinator, only merged pushes of
    `inner_steps` (H) or more make the history."""
    column = {"norm": "norm", "deviation": "deviation"}[of]  # a column name, never the caller's text
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        rows = db.execute(
            f"SELECT fragment, worker_id, {column}, state, received, base_version, steps FROM pushes "
            f"WHERE {column} IS NOT NULL AND {column} > 0 ORDER BY received"
        ).fetchall()
    accepted: dict[int, list[tuple[str, float]]] = {}  # per fragment: (worker, norm), oldest first
    out: list[dict[str, Any]] = []
    for fragment, worker, norm, state, received, base, steps in rows:
        recent = accepted.setdefault(fragment, [])[-NORM_HISTORY:]
        reference = norm_reference([n for _, n in recent], [w for w, _ in recent], worker)
        if reference is not None and reference[0] > 0:
            out.append({"ratio": norm / reference[0], "fragment": fragment, "worker": worker,
                        "base_version": base, "t": received - rows[0][4], "state": state})  # fmt: skip
        if state == "merged" and steps >= inner_steps:
            accepted[fragment].append((worker, norm))
    return out


def summary(pushes: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = sorted(p["ratio"] for p in pushes)
    if not ratios:
        return {"pushes": 0}

    def pct(q: float) -> float:
        return round(ratios[min(len(ratios) - 1, int(q * len(ratios)))], 3)

    return {
        "pushes": len(ratios), "median": round(statistics.median(ratios), 3), "p90": pct(0.9),
        "p99": pct(0.99), "max": round(ratios[-1], 3),
        "above": {f"{bar:g}": sum(r > bar for r in ratios) for bar in BARS},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdirs", nargs="+", type=Path, help="run workdirs (their state/ledger.sqlite)")
    p.add_argument("--of", choices=["norm", "deviation"], default="norm",
                   help="the outlier check's norms, or sync.center_clip's deviations from the mean step")  # fmt: skip
    p.add_argument("--show", type=float, default=0.0, help="list the pushes above this ratio")
    p.add_argument("--out", type=Path, help="write the summaries here as JSON")
    args = p.parse_args(argv)
    results = {}
    for workdir in args.workdirs:
        inner_steps = RunConfig.from_toml(workdir / "run.toml").train.inner_steps
        pushes = push_ratios(workdir / "state" / "ledger.sqlite", inner_steps, args.of)
        results[str(workdir)] = summary(pushes)
        print(workdir, json.dumps(results[str(workdir)]))
        for push in (q for q in pushes if args.show and q["ratio"] > args.show):
            print(f"  t={push['t']:7.1f}s fragment {push['fragment']} {push['worker']} on v{push['base_version']}: "
                  f"{push['ratio']:.2f}x ({push['state']})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
