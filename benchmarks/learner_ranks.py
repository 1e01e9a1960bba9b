"""A learner of N ranks (a torchrun group, DDP or FSDP2 inside) against a learner of one process.

    python benchmarks/learner_ranks.py --ranks 2 --pairs 3 --tokens 400000 [--data-parallel fsdp]

Each pair is two `diloco run`s of one seed, one learner each, one thread per rank: the whole
1-rank job (coordinator and data worker included) pinned to one core, the whole N-rank job to N
cores (taskset; N ≤ this machine's cores), so each learner shares its cores with the same parts
around it. Both
train the same batch (train.batch_size rows a step, split over the ranks), so the arithmetic per
token is the same and the group can only gain by its cores. Printed per pair and over pairs
(mean, spread, worst): the speed-up in tokens per second inside inner steps (the learner's own
speed: its start-up and the data side left out), the final eval of each, and the coordinator's
bytes per token (a group must cost what one learner costs). Arms alternate in order across pairs,
so neither always runs first on a cold machine. Writes benchmarks/results/learner_ranks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import diloco_run  # noqa: E402
from benchmarks.quality import spread  # noqa: E402


def arm(
    workdir: Path,
    ranks: int,
    seed: int,
    tokens: int,
    batch: int,
    timeout_s: float,
    data_parallel: str = "ddp",
) -> dict[str, Any]:
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:ranks])
    summary = diloco_run(
        f"ranks{ranks}-seed{seed}",
        workdir,
        ["--learners", "1", "--learner-ranks", str(ranks), "--data-workers", "1", "--seed", str(seed),
         "--tokens", str(tokens), "--minutes", "0", "--http-port", "-1",
         "--set", "train.threads=1", "--set", f"train.batch_size={batch}",
         # Shards made ahead, so the data worker is mostly done before the learner's steps.
         "--set", "data.max_ready_shards=64", "--data-parallel", data_parallel],
        timeout_s,
        prefix=["taskset", "-c", cores],
    )  # fmt: skip
    (learner,) = summary["learners_detail"].values()
    return {
        "ranks": ranks,
        "tokens_per_s": learner["tokens_per_s"],
        "eval_loss": summary["eval_loss"],
        "wire_bytes_per_token": summary["steady_wire_bytes_per_token"],
        "tokens_trained": summary["tokens_trained"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], default="ddp", help="inside the group")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learner_ranks.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.ranks > cores:
        raise SystemExit(f"{args.ranks} ranks need {args.ranks} cores; this machine has {cores}")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="diloco-ranks-") as tmp:
        for i in range(args.pairs):
            seed = i + 1
            order = (1, args.ranks) if i % 2 == 0 else (args.ranks, 1)
            runs = {
                r: arm(Path(tmp), r, seed, args.tokens, args.batch, args.timeout, args.data_parallel)
                for r in order
            }
            one, group = runs[1], runs[args.ranks]
            row = {
                "seed": seed,
                "first": order[0],
                "one": one,
                "group": group,
                "speedup": group["tokens_per_s"] / one["tokens_per_s"],
                "eval_ratio": group["eval_loss"] / one["eval_loss"],
                "wire_ratio": group["wire_bytes_per_token"] / one["wire_bytes_per_token"],
            }
            pairs.append(row)
            print(
                f"seed {seed}: 1 rank {one['tokens_per_s']:,.0f} tok/s, {args.ranks} ranks "
                f"{group['tokens_per_s']:,.0f} tok/s -> {row['speedup']:.2f}x; eval {one['eval_loss']:.4f} "
                f"vs {group['eval_loss']:.4f}; wire bytes/token ratio {row['wire_ratio']:.3f}",
                flush=True,
            )
    result = {
        "ranks": args.ranks,
        "data_parallel": args.data_parallel,
        "cores": cores,
        "tokens": args.tokens,
        "batch_size": args.batch,
        "pairs": pairs,
        "speedup": spread([p["speedup"] for p in pairs]),
        "eval_ratio": spread([p["eval_ratio"] for p in pairs]),
        "wire_ratio": spread([p["wire_ratio"] for p in pairs]),
        "target": f"speed-up >= 1.8 at {args.ranks}x the cores; wire ratio 1.0",
    }
    print(json.dumps({k: result[k] for k in ("speedup", "eval_ratio", "wire_ratio")}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
