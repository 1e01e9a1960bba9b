"""A finished run's short rounds made again at the outer step `sync.short_push_scale` gives them:
what would the run have ended at, had the merger scaled them?

    python benchmarks/replay_short_rounds.py RUN_DIR [RUN_DIR ...] [--mode balanced] [--out replay.json]

For each fragment, from its first round whose factor is below --from (0.95) to its last, every
merge is made again from the checkpoints: its outer gradient comes back exactly from the two
checkpoints around it (m_v = g + μ^f · m_{v−1}), is scaled by the factor of its pushes' steps
(the ledger's), and the outer step is taken again from the replayed parameters and momentum.
The learners' deltas are the ones the run merged: a replay, not a rerun, so it fits the end
game (nothing learned after those merges), and a run's final loss is compared as run and
replayed. Needs every version of the replayed rounds (`coordinator.keep_versions=0`, e.g.
`chaos.py --history --keep DIR`), and a run made without the scaling (`sync.short_push_scale=none`).
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

from benchmarks.merge_evals import RunModel  # noqa: E402
from diloco.coordinator import merging  # noqa: E402


def push_steps(workdir: Path) -> dict[tuple[int, int], list[int]]:
    """(fragment, merged version) -> the inner steps of each push that version merged."""
    steps: dict[tuple[int, int], list[int]] = {}
    with sqlite3.connect(workdir / "state" / "ledger.sqlite") as db:
        query = "SELECT fragment, merged_version, steps FROM pushes WHERE state = 'merged'"
        for fragment, version, n in db.execute(query):
            steps.setdefault((fragment, version), []).append(n)
    return steps


def replay(workdir: Path, mode: str, below: float) -> dict[str, Any]:
    run = RunModel(workdir)
    kept, steps, rounds = run.kept(), push_steps(workdir), run.rounds()
    h, replaced, merges = run.cfg.train.inner_steps, {}, []
    for fragment in range(len(run.final)):
        params = momentum = None
        for f, version, _, pushes, _, total, _, coverage in rounds:
            if f != fragment or version <= 1:  # a fragment's first merge is never scaled
                continue
            factor = merging.short_push_scale(steps.get((f, version), []), h, mode)
            if params is None and factor >= below:
                continue
            if (f, version - 1) not in kept or (f, version) not in kept:
                raise SystemExit(
                    f"{workdir}: fragment {f} v{version - 1}..{version} not kept (keep_versions=0?)"
                )
            step = run.merge_step(f, version, pushes, total, coverage)
            if step.error > 1e-4:
                raise SystemExit(
                    f"{workdir}: fragment {f} v{version} does not replay ({step.error:.1e}): another rule?"
                )
            if params is None:
                params, momentum = step.params, step.momentum
            params, momentum = step.take(params, momentum, factor)
            merges.append(
                {"fragment": f, "version": version, "steps": steps.get((f, version)), "factor": factor}
            )
        if params is not None:
            replaced.update(params)
    as_run = run.loss_of(run.final)
    replayed = run.loss_of(run.final, replaced) if replaced else as_run
    return {"run": str(workdir), "as_run": as_run, "replayed": replayed, "change": replayed / as_run - 1,
            "merges": merges}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--mode", default="balanced", help="sync.short_push_scale to replay with")
    p.add_argument(
        "--from", dest="below", type=float, default=0.95, help="replay from the first factor below this"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    for workdir in args.runs:
        r = replay(workdir, args.mode, args.below)
        results.append(r)
        rounds = ", ".join(
            f"f{m['fragment']} v{m['version']} {m['steps']} x{m['factor']:.2f}" for m in r["merges"]
        )
        print(
            f"{workdir}: {r['as_run']:.4f} as run, {r['replayed']:.4f} replayed ({r['change']:+.2%}): {rounds or '-'}"
        )
    changes = [r["change"] for r in results]
    if len(changes) > 1:
        print(
            f"over {len(changes)} runs: {statistics.mean(changes):+.2%} on average, worst {max(changes):+.2%}"
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"mode": args.mode, "from": args.below, "runs": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
