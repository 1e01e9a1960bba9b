"""DDP and diloco side by side: same model, same data, same token budget, measured in one run.

    python benchmarks/compare.py --tokens 2000000 --workers 2 --out benchmarks/results/compare.json

Prints eval loss (on the same held-out rows), wall time, and bytes on the wire per trained token
for each arm, and the ratios against DDP. Every arm runs in its own processes on 127.0.0.1, one
after the other, so they do not share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_baseline import run_ddp  # noqa: E402
from diloco.run import EVAL_MAX_BATCHES, default_run_config  # noqa: E402

# Each diloco arm: a name and the `diloco run` flags that make it. Later arms (the asynchronous
# syncer, codecs) are added here so every comparison stays in one table.
DILOCO_ARMS: dict[str, list[str]] = {
    "diloco-sync": ["--quorum", "0", "--fragments", "1"],
}


def run_diloco(
    name: str,
    flags: list[str],
    config_path: Path,
    tokens: int,
    workers: int,
    workdir: Path,
    max_minutes: float,
) -> dict[str, Any]:
    started = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "run",
        "--config",
        str(config_path),
        "--tokens",
        str(tokens),
        "--minutes",
        str(max_minutes),
        "--learners",
        str(workers),
        "--data-workers",
        "2",
        "--workdir",
        str(workdir / name),
        "--name",
        name,
        "--no-progress",
        *flags,
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max_minutes * 60 + 600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((workdir / name / "summary.json").read_text())
    summary["process_seconds"] = time.perf_counter() - started
    return summary


def row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "arm": name,
        "eval_loss": r["eval_loss"],
        "baseline_loss": r.get("baseline_loss", r.get("eval_unigram_entropy")),
        "tokens_trained": r["tokens_trained"],
        "wall_seconds": r["wall_seconds"],
        "wire_bytes": r["wire_bytes"],
        "wire_bytes_per_token": r["wire_bytes"] / max(1, r["tokens_trained"]),
        "tokens_per_s": r["tokens_trained"] / max(1e-9, r["wall_seconds"]),
        "utilization": r.get("utilization"),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    ddp = rows[0]
    header = f"{'arm':<16}{'eval loss':>10}{'unigram':>9}{'tokens':>12}{'wall s':>9}{'tok/s':>9}{'wire B/tok':>12}{'vs DDP':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = (
            ddp["wire_bytes_per_token"] / r["wire_bytes_per_token"]
            if r["wire_bytes_per_token"]
            else float("inf")
        )
        print(
            f"{r['arm']:<16}{r['eval_loss']:>10.4f}{r['baseline_loss']:>9.4f}{r['tokens_trained']:>12,}"
            f"{r['wall_seconds']:>9.1f}{r['tokens_per_s']:>9.0f}{r['wire_bytes_per_token']:>12.2f}{ratio:>9.1f}x"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=2_000_000, help="token budget per arm (all workers together)"
    )
    p.add_argument("--workers", type=int, default=2, help="DDP ranks = diloco learners")
    p.add_argument("--dataset", default="stdlib")
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=30.0, help="safety bound per arm")
    p.add_argument("--arms", default=",".join(["ddp", *DILOCO_ARMS]), help="comma-separated arms to run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compare.json")
    args = p.parse_args(argv)

    cfg = default_run_config().with_overrides(
        {
            "data.dataset": args.dataset,
            "train.inner_steps": args.inner_steps,
            "train.threads": max(1, (os.cpu_count() or 1) // args.workers),
        }
    )
    arms = args.arms.split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="diloco_compare_") as tmp:
        config_path = Path(tmp) / "run.toml"
        config_path.write_text(cfg.to_toml())
        if "ddp" in arms:
            print(f"== ddp: {args.workers} ranks, {args.tokens:,} tokens", file=sys.stderr)
            results["ddp"] = run_ddp(
                cfg,
                workers=args.workers,
                max_tokens=args.tokens,
                max_seconds=args.max_minutes * 60,
                eval_batches=EVAL_MAX_BATCHES,
                log_every=0,
            )
        for name in arms:
            if name in DILOCO_ARMS:
                print(f"== {name}: {args.workers} learners, {args.tokens:,} tokens", file=sys.stderr)
                results[name] = run_diloco(
                    name,
                    DILOCO_ARMS[name],
                    config_path,
                    args.tokens,
                    args.workers,
                    Path(tmp),
                    args.max_minutes,
                )
    rows = [row(name, r) for name, r in results.items()]
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"rows": rows, "raw": results, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2
        )
        + "\n"
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
