"""A long chaos run beside a fault-free one: same seed, same data, same token budget.

    python benchmarks/chaos.py --tokens 3000000 --chaos-interval 6 --out benchmarks/results/chaos.json

The chaos run SIGKILLs a random process (coordinator, data worker or learner) every ~interval
seconds and restarts it as a supervisor would; the ledger is audited at the end. Printed: kills by
role, chunks, tokens trained and merged, rounds, the longest time the syncer made no progress,
audit result, and the final eval loss next to the fault-free run's.

    python benchmarks/chaos.py --tokens 1000000 --pairs 1:5,2:10,3:20,4:30 --null

`--null` runs each seed's fault-free twin twice and prints the second against the first: a
Decoupled run's rounds depend on timing, so that spread is the floor under any chaos figure.

`--history` keeps every checkpoint of both runs and compares their losses after every merge at
matched merged tokens over the last half of the run (benchmarks/merge_evals.py): the final losses
alone differ by where each run's last merges fell as well as by what the chaos cost. Every merge's
loss of both runs goes into the results (`runs[i].merges`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The readers of a finished run (merge_evals, round_timeline), imported when used.
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def keep_or_temp(keep: Path | None, prefix: str) -> Iterator[str]:
    """Where a benchmark's runs go: `keep` (left for reading afterwards), else a temp folder."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        # A run started in an earlier run's workdir resumes it (measured: four "chaos" runs with
        # no kill, each going on from a finished run of an earlier session).
        if old := sorted(p.name for p in keep.iterdir() if (p / "summary.json").exists()):
            raise SystemExit(f"{keep} holds finished runs ({', '.join(old)}): keep the runs in a new folder")
        yield str(keep)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def diloco_run(
    name: str, workdir: Path, args: list[str], timeout_s: float, prefix: list[str] | None = None
) -> dict[str, Any]:
    """`diloco run ARGS` (after `prefix`, e.g. `taskset -c 0`) and its summary."""
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "cli",
        "run",
        "--workdir",
        str(workdir / name),
        "--name",
        name,
        "--no-progress",
        # The evaluator only watches: off, so the figures compare with the baselines' and earlier runs'.
        "--set",
        "eval.every_s=0",
        *args,
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((workdir / name / "summary.json").read_text())
    summary["push_spread_s"] = push_spread_s(workdir / name)
    return summary


def push_spread_s(workdir: Path) -> float | None:
    """A finished run's mean seconds from a round's first push to its last (round_timeline)."""
    from benchmarks.round_timeline import mean_spread_s, timeline

    return mean_spread_s(timeline(workdir, 0.0))


def pair_row(
    calm: dict[str, Any], chaos: dict[str, Any], seed: int, interval: float, roles: str
) -> dict[str, Any]:
    """One chaos run next to its fault-free twin (same seed, same merged-token budget)."""
    ratio = (
        chaos["eval_loss"] / calm["eval_loss"] - 1.0
        if calm.get("eval_loss") and chaos.get("eval_loss")
        else None
    )
    return {
        "seed": seed,
        "interval_s": interval,
        "roles": roles,
        "kills": chaos.get("kills", {}),
        "eval_fault_free": calm.get("eval_loss"),
        "eval_chaos": chaos.get("eval_loss"),
        "eval_ratio": ratio,
        "tokens_merged": [calm.get("tokens_merged"), chaos.get("tokens_merged")],
        "audit_ok": chaos.get("audit_ok"),
        "goodput": [calm.get("goodput"), chaos.get("goodput")],
        "longest_merge_gap_s": chaos.get("longest_merge_gap_s"),
        "push_spread_s": [calm.get("push_spread_s"), chaos.get("push_spread_s")],
    }


def matched_history(
    folder: Path, twin: str, run: str, histories: dict[str, list[dict[str, Any]]]
) -> dict[str, float]:
    """`run` against `twin` after every merge, at matched merged tokens (merge_evals.matched_gap)."""
    from benchmarks.merge_evals import matched_gap, merge_history

    for name in (twin, run):
        if name not in histories:
            histories[name] = merge_history(folder / name)
    return matched_gap(histories[twin], histories[run])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=3_000_000)
    p.add_argument("--chaos-interval", type=float, default=6.0)
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--pairs",
        default="",
        help="several pairs: SEED:INTERVAL[:ROLES],... (ROLES as --chaos-roles, '+'-separated; default all)",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--null",
        action="store_true",
        help="run each seed's fault-free twin twice: the second against the first is the noise floor "
        "(which Decoupled round a push lands in depends on timing, so one seed's runs differ)",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' workdirs under this folder")
    p.add_argument(
        "--history",
        action="store_true",
        help="keep every checkpoint and compare the runs after every merge at matched tokens (merge_evals.py)",
    )
    p.add_argument("--max-minutes", type=float, default=60.0, help="safety bound per run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos.json")
    args = p.parse_args(argv)

    pairs = [(args.seed, args.chaos_interval, "")]
    if args.pairs:
        pairs = []
        for item in args.pairs.split(","):
            seed, interval, *roles = item.split(":")
            pairs.append((int(seed), float(interval), roles[0].replace("+", ",") if roles else ""))
    timeout = args.max_minutes * 60 + 600
    rows, runs, nulls = [], [], []
    histories: dict[str, list[dict[str, Any]]] = {}
    calms: dict[int, dict[str, Any]] = {}
    with keep_or_temp(args.keep, "diloco_chaos_") as tmp:
        for i, (seed, interval, roles) in enumerate(pairs):
            common = ["--tokens", str(args.tokens), "--minutes", str(args.max_minutes),
                      "--learners", str(args.learners), "--seed", str(seed)]  # fmt: skip
            for item in args.overrides:
                common += ["--set", item]
            if args.history:
                common += ["--set", "coordinator.keep_versions=0"]
            if seed not in calms:  # the fault-free twin of a seed is the same run for every interval
                print(f"== fault-free, seed {seed}", file=sys.stderr, flush=True)
                calms[seed] = diloco_run(f"fault-free-{seed}", Path(tmp), common, timeout)
                if args.null:
                    print(f"== fault-free again, seed {seed}", file=sys.stderr, flush=True)
                    again = diloco_run(f"fault-free-{seed}-again", Path(tmp), common, timeout)
                    nulls.append(pair_row(calms[seed], again, seed, 0.0, "none"))
                    print(f"   noise floor: {nulls[-1]['eval_ratio']:+.2%}", file=sys.stderr, flush=True)
            extra = ["--chaos-interval", str(interval)] + (["--chaos-roles", roles] if roles else [])
            print(
                f"== chaos every ~{interval:g}s ({roles or 'all roles'}), seed {seed}",
                file=sys.stderr,
                flush=True,
            )
            chaos = diloco_run(f"chaos-{i}", Path(tmp), [*common, *extra], timeout)
            rows.append(pair_row(calms[seed], chaos, seed, interval, roles or "all"))
            runs.append({"fault_free": calms[seed], "chaos": chaos})
            r = rows[-1]
            spread = " -> ".join(f"{x:.2f}" if x is not None else "-" for x in r["push_spread_s"])
            print(f"   eval {r['eval_fault_free']:.4f} -> {r['eval_chaos']:.4f} ({r['eval_ratio']:+.2%}), "
                  f"kills {sum(r['kills'].values())}, audit {r['audit_ok']}, a round's pushes {spread} s apart",
                  file=sys.stderr, flush=True)  # fmt: skip
            if args.history:
                r["matched"] = matched_history(Path(tmp), f"fault-free-{seed}", f"chaos-{i}", histories)
                # Every merge's loss, kept with the results: which merge did it, after the workdirs are gone.
                runs[-1]["merges"] = {
                    "fault_free": histories[f"fault-free-{seed}"],
                    "chaos": histories[f"chaos-{i}"],
                }
                print(f"   matched over the last half: mean {r['matched']['mean']:+.2%}, worst "
                      f"{r['matched']['worst']:+.2%}", file=sys.stderr, flush=True)  # fmt: skip

    print(
        f"{'seed':>5}{'every':>7}{'roles':>22}{'kills':>7}{'fault-free':>12}{'chaos':>9}{'ratio':>9}{'audit':>7}"
    )
    for r in rows:
        print(f"{r['seed']:>5}{r['interval_s']:>6g}s{r['roles']:>22}{sum(r['kills'].values()):>7}"
              f"{r['eval_fault_free']:>12.4f}{r['eval_chaos']:>9.4f}{r['eval_ratio']:>+9.2%}{str(r['audit_ok']):>7}")  # fmt: skip
    # Chaos is judged on its cost (at most 2% worse than its twin); the noise floor both ways.
    for label, group, worst_of in (
        ("chaos vs fault-free", rows, max),
        ("fault-free vs fault-free (noise floor)", nulls, None),
    ):
        ratios = [r["eval_ratio"] for r in group if r["eval_ratio"] is not None]
        if ratios:
            mean = sum(ratios) / len(ratios)
            spread = (sum((x - mean) ** 2 for x in ratios) / max(1, len(ratios) - 1)) ** 0.5
            worst = worst_of(ratios) if worst_of else max(ratios, key=abs)
            within = sum((x if worst_of else abs(x)) <= 0.02 for x in ratios)
            print(f"{label} over {len(ratios)} pair(s): mean {mean:+.2%}, sd {spread:.2%}, worst {worst:+.2%}; "
                  f"within 2%: {within}/{len(ratios)}")  # fmt: skip
    matched = [r["matched"] for r in rows if "matched" in r]
    if matched:
        means = [m["mean"] for m in matched]
        print(f"matched over the last half, {len(matched)} pair(s): mean gap {sum(means) / len(means):+.2%} "
              f"(pairs {min(means):+.2%} to {max(means):+.2%}), worst point {max(m['worst'] for m in matched):+.2%}; "
              f"pairs whose every point is within 2%: {sum(m['worst'] <= 0.02 for m in matched)}/{len(matched)}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "pairs": rows,
        "noise_floor": nulls,
        "runs": runs,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
