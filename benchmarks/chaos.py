"""A long chaos run beside a fault-free one: same seed, same data, same token budget.

    python benchmarks/chaos.py --tokens 3000000 --chaos-interval 6 --out benchmarks/results/chaos.json

The chaos run SIGKILLs a random process (coordinator, data worker or learner) every ~interval
seconds and restarts it as a supervisor would; the ledger is audited at the end. Printed: kills by
role, chunks, tokens trained and merged, rounds, the longest time the syncer made no progress,
audit result, and the final eval loss next to the fault-free run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def diloco_run(name: str, workdir: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "run",
        "--workdir",
        str(workdir / name),
        "--name",
        name,
        "--no-progress",
        *args,
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((workdir / name / "summary.json").read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=3_000_000)
    p.add_argument("--chaos-interval", type=float, default=6.0)
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=60.0, help="safety bound per run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos.json")
    args = p.parse_args(argv)

    common = ["--tokens", str(args.tokens), "--minutes", str(args.max_minutes), "--learners", str(args.learners),
              "--seed", str(args.seed)]  # fmt: skip
    timeout = args.max_minutes * 60 + 600
    with tempfile.TemporaryDirectory(prefix="diloco_chaos_") as tmp:
        print("== fault-free", file=sys.stderr, flush=True)
        calm = diloco_run("fault-free", Path(tmp), common, timeout)
        print(f"== chaos every ~{args.chaos_interval:g}s", file=sys.stderr, flush=True)
        chaos = diloco_run(
            "chaos", Path(tmp), [*common, "--chaos-interval", str(args.chaos_interval)], timeout
        )

    keys = ["kills", "chunks", "chunks_done", "chunks_quarantined", "tokens_trained", "tokens_merged", "rounds",
            "eval_loss", "longest_merge_gap_s", "wall_seconds", "audit_ok", "audit_violations"]  # fmt: skip
    print(f"{'':<22}{'fault-free':>20}{'chaos':>28}")
    for key in keys:
        print(f"{key:<22}{json.dumps(calm.get(key)):>20}{json.dumps(chaos.get(key)):>28}")
    ratio = chaos["eval_loss"] / calm["eval_loss"] - 1.0
    print(f"eval loss, chaos vs fault-free: {ratio:+.2%}; kills: {sum(chaos['kills'].values())}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"fault_free": calm, "chaos": chaos, "eval_loss_ratio": ratio, "args": vars(args)}
    args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
