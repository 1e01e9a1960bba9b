"""DDP, synchronous DiLoCo and Decoupled DiLoCo side by side: same model, data and token budget.

    python benchmarks/compare.py --tokens 1500000 --workers 4 --out benchmarks/results/compare.json
    python benchmarks/compare.py --model examples/hf-llama/run.toml --workers 2 --no-slow \
        --arms ddp,decoupled --tokens 1000000                      # a tiny Llama: diloco vs DDP

Each arm runs fault-free and with one worker made 3× slower (an injected delay per step). For
each: eval loss (on the same held-out rows), tokens trained and merged per second, learner
utilization (share of wall time in inner steps; the slowest of the *other* learners too), and
bytes on the wire per trained token. Arms run one after the other in their own processes on
127.0.0.1, so they never share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_baseline import run_ddp  # noqa: E402
from diloco.config import parse_assignments  # noqa: E402
from diloco.local.evaluation import EVAL_MAX_BATCHES  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.local.summary import ddp_wire_bytes_per_token  # noqa: E402

# The "torchft" arm (torchft's own DiLoCo, a peer baseline) needs the optional torchft package.
try:
    from benchmarks.torchft_baseline import run_torchft  # noqa: E402
except ImportError as e:
    if (e.name or "").split(".")[0] != "torchft":
        raise  # torchft is there: the baseline itself is broken, say so
    run_torchft = None
    TORCHFT_MISSING = str(e)
# Arms whose every trained token is applied at once (no partial merges): DDP, torchft's DiLoCo.
MERGE_ALL_MODES = ("ddp", "torchft-diloco")

# The diloco arms: `diloco run` flags. Later comparisons (codecs, ...) add arms here.
DILOCO_ARMS: dict[str, list[str]] = {
    "sync-diloco": ["--sync"],
    "sync-int4": ["--sync", "--codec", "int4", "--pull-codec", "int4"],
    "decoupled": ["--quorum", "1", "--fragments", "2"],
    # Codecs both ways (pushes and pulls), for wire bytes and loss at equal tokens vs fp32.
    "decoupled-bf16": ["--quorum", "1", "--fragments", "2", "--codec", "bf16", "--pull-codec", "bf16"],
    "decoupled-int8": ["--quorum", "1", "--fragments", "2", "--codec", "int8", "--pull-codec", "int8"],
    "decoupled-int4": ["--quorum", "1", "--fragments", "2", "--codec", "int4", "--pull-codec", "int4"],
}
DEFAULT_ARMS = ["ddp", "sync-diloco", "decoupled"]


def run_diloco(
    name: str,
    flags: list[str],
    config_path: Path,
    tokens: int,
    workers: int,
    workdir: Path,
    max_minutes: float,
    ranks: int = 1,
    prefix: list[str] | None = None,
) -> dict[str, Any]:
    """`diloco run` of one arm (under `prefix`, e.g. `ip netns exec NS`) and its summary."""
    cmd = [
        *(prefix or []), sys.executable, "-m", "cli", "run", "--config", str(config_path), "--tokens", str(tokens),
        "--minutes", str(max_minutes), "--learners", str(workers), "--data-workers", "2",
        "--learner-ranks", str(ranks), "--workdir", str(workdir / name), "--name", name, "--no-progress",
        "--set", "eval.every_s=0",  # the evaluator only watches; DDP and torchft have none
        *flags,
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max_minutes * 60 + 600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((workdir / name / "summary.json").read_text())


def row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    wall = max(1e-9, r["wall_seconds"])
    ddp = r.get("mode") in MERGE_ALL_MODES
    return {
        "arm": name,
        "eval_loss": r["eval_loss"],
        "baseline_loss": r.get("baseline_loss", r.get("eval_unigram_entropy")),
        "tokens_trained": r["tokens_trained"],
        "wall_seconds": r["wall_seconds"],
        "trained_tokens_per_s": r["tokens_trained"] / wall,
        # The training loops' own speed: peers time theirs from a start barrier; a diloco run's
        # wall also holds its start-up (processes, joins, first shards) and the final flush.
        "loop_tokens_per_s": r["tokens_trained"] / wall if ddp else r.get("learner_tokens_per_s", 0.0),
        # ...less a Decoupled run's end game (waits for the token budget's last allowances): peers
        # have none, each rank or replica stops at its share
        "loop_tokens_per_s_outside_budget_waits": r["tokens_trained"] / wall
        if ddp
        else r.get("learner_tokens_per_s_outside_budget_waits"),
        # ...per CPU-second the learners' (ranks', replicas') processes used over their loops: the
        # loops' own cost, whatever the job's other roles took of a shared machine's cores
        "loop_tokens_per_cpu_s": r.get("tokens_per_cpu_s") if ddp else r.get("learner_tokens_per_cpu_s"),
        # DDP applies every step's gradient at once, torchft's DiLoCo stops only after a round's
        # outer step: everything they train is merged.
        "merged_tokens_per_s": r["tokens_trained"] / wall if ddp else r["merged_tokens_per_s"],
        "merged_share": 1.0 if ddp else r["tokens_merged"] / max(1, r["tokens_trained"]),
        "utilization": None if ddp else r["utilization"],
        "utilization_min_others": None if ddp else r["utilization_min_others"],
        "wire_bytes_per_token": r["wire_bytes"] / max(1, r["tokens_trained"]),
        # Inside each learner of N ranks: DDP's all-reduce of fp32 gradients every step, on the
        # node's own links (a ring estimate; none for a learner of one process).
        "within_learner_bytes_per_token": within_bytes_per_token(r),
    }


def within_bytes_per_token(r: dict[str, Any]) -> float:
    ranks = max((r.get("ranks_per_learner") or {}).values(), default=1)
    if ranks < 2 or "params" not in r:
        return 0.0
    cfg = r["config"]
    return ddp_wire_bytes_per_token(
        r["params"], ranks, cfg["train"]["batch_size"] / ranks, cfg["model"]["seq_len"] + 1
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    header = (f"{'arm':<20}{'eval loss':>10}{'tok/s':>9}{'loop tok/s':>11}{'tok/CPU-s':>10}{'merged/s':>10}{'merged':>8}"
              f"{'util':>8}{'util min':>9}{'wire B/tok':>12}{'within B/tok':>13}{'wall s':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        cpu = r.get("loop_tokens_per_cpu_s")
        print(f"{r['arm']:<20}{r['eval_loss']:>10.4f}{r['trained_tokens_per_s']:>9.0f}{r['loop_tokens_per_s']:>11.0f}"
              f"{'-' if cpu is None else f'{cpu:.0f}':>10}"
              f"{r['merged_tokens_per_s']:>10.0f}"
              f"{pct(r['merged_share']):>8}{pct(r['utilization']):>8}{pct(r['utilization_min_others']):>9}"
              f"{r['wire_bytes_per_token']:>12.2f}{r['within_learner_bytes_per_token']:>13.2f}"
              f"{r['wall_seconds']:>8.1f}")  # fmt: skip


def model_overrides(model: str) -> dict[str, Any]:
    """--model as config overrides: a factory, or the [model] table of a run.toml."""
    if not model:
        return {}
    if not model.endswith(".toml"):
        return {"model.factory": model, "model.kwargs": {}}
    with open(model, "rb") as f:
        table = tomllib.load(f).get("model", {})
    return {f"model.{key}": value for key, value in table.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=1_500_000, help="token budget per arm (all workers together)"
    )
    p.add_argument(
        "--workers", type=int, default=4, help="DDP ranks = diloco learners (times --learner-ranks)"
    )
    p.add_argument(
        "--learner-ranks", type=int, default=1,
        help="N: each diloco learner a torchrun group of N ranks, against DDP over workers × N ranks "
             "(train.batch_size is a learner's rows; DDP's ranks take batch_size / N each)",
    )  # fmt: skip
    p.add_argument("--dataset", default="stdlib")
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--slow-factor", type=float, default=3.0, help="the straggler's slowdown in the slow arms")
    p.add_argument("--max-minutes", type=float, default=30.0, help="safety bound per arm")
    p.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated, of: ddp, torchft, {', '.join(DILOCO_ARMS)}",
    )
    p.add_argument("--no-slow", action="store_true", help="fault-free arms only")
    p.add_argument("--init-from", default="", help="start every diloco arm from this model.safetensors")
    p.add_argument("--model", default="",
                   help='every arm\'s model: a factory "package.module:function", or a run.toml whose [model] '
                        "is taken (e.g. examples/hf-llama/run.toml)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm, e.g. train.batch_size=4 (repeatable)")  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compare.json")
    args = p.parse_args(argv)

    threads = max(1, (os.cpu_count() or 1) // (args.workers * args.learner_ranks))
    cfg = (
        default_run_config()
        .with_overrides(
            {
                "data.dataset": args.dataset,
                "train.inner_steps": args.inner_steps,
                "train.threads": threads,
                "model.init_from": args.init_from,
            }  # fmt: skip
        )
        .with_overrides(model_overrides(args.model))
        .with_overrides(parse_assignments(args.overrides))
        .validate()
    )
    slow_variants = [1.0] if args.no_slow else [1.0, args.slow_factor]
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco_compare_") as tmp:
        config_path = Path(tmp) / "run.toml"
        config_path.write_text(cfg.to_toml())
        for arm in args.arms.split(","):
            if arm == "torchft" and run_torchft is None:
                print(f"== torchft: skipped, torchft is not importable ({TORCHFT_MISSING})", file=sys.stderr, flush=True)  # fmt: skip
                continue
            for slow in slow_variants:
                name = arm if slow == 1.0 else f"{arm}-slow{slow:g}x"
                print(
                    f"== {name}: {args.workers} workers, {args.tokens:,} tokens", file=sys.stderr, flush=True
                )
                if arm == "ddp":
                    ddp_cfg = cfg.with_overrides(
                        {"train.batch_size": max(1, cfg.train.batch_size // args.learner_ranks)}
                    )  # the same global batch: M learners of N ranks
                    results[name] = run_ddp(ddp_cfg, workers=args.workers * args.learner_ranks, max_tokens=args.tokens,
                                            max_seconds=args.max_minutes * 60, eval_batches=EVAL_MAX_BATCHES,
                                            log_every=0, slow_factor=slow)  # fmt: skip
                elif arm == "torchft":
                    assert run_torchft is not None
                    results[name] = run_torchft(cfg, workers=args.workers, max_tokens=args.tokens,
                                                max_seconds=args.max_minutes * 60, eval_batches=EVAL_MAX_BATCHES,
                                                log_every=0, slow_factor=slow)  # fmt: skip
                else:
                    flags = DILOCO_ARMS[arm] + (["--slow-learner", str(slow)] if slow > 1.0 else [])
                    results[name] = run_diloco(name, flags, config_path, args.tokens, args.workers, Path(tmp),
                                               args.max_minutes, args.learner_ranks)  # fmt: skip
    rows = [row(name, r) for name, r in results.items()]
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"rows": rows, "raw": results, "args": {k: str(v) for k, v in vars(args).items()},
               "seconds": time.perf_counter() - started}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
