"""Training quality over seeds: DDP, synchronous DiLoCo and Decoupled DiLoCo, paired by seed.

    python benchmarks/quality.py --cells 2x50,4x50,2x100,4x100,8x50 --models default,2layer \
        --seeds 1,2,3 --tokens 1228800 --out benchmarks/results/quality.json

A cell is M learners (= DDP ranks) at H inner steps. In each cell, for each model and seed, every
arm trains the same model on the same token budget, one arm after the other (they never share the
machine's cores), and is evaluated on the same held-out rows. Per cell it prints each arm's eval
loss (mean, spread, worst over seeds) and the paired ratios the targets are about:
decoupled / sync-diloco and sync-diloco / ddp, each computed per seed before averaging, so a lucky
seed helps both arms of a pair. `--variant NAME='flags'` adds an arm of `diloco run` flags (to
measure a candidate cause: `--variant tau0='--overlap 0'`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import DILOCO_ARMS, row, run_diloco  # noqa: E402
from benchmarks.ddp_baseline import run_ddp  # noqa: E402
from diloco.config import RunConfig, parse_assignments  # noqa: E402
from diloco.local.evaluation import EVAL_MAX_BATCHES  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402

PEER_ARMS = ("ddp", "torchft")

MODELS: dict[str, dict[str, Any]] = {
    "default": {},
    # The small config: 2 layers, batch 8, no warm-up (the torchft comparison's).
    "2layer": {"model.kwargs.n_layer": 2, "train.batch_size": 8, "train.warmup_steps": 0},
}
# The pairs the targets are stated for: (arm, reference arm).
PAIRS = [("decoupled", "sync-diloco"), ("sync-diloco", "ddp"), ("torchft", "ddp")]


def run_peer(
    arm: str, cfg: RunConfig, workers: int, tokens: int, max_minutes: float
) -> dict[str, Any] | None:
    """A peer baseline in this process tree: DDP, or torchft's DiLoCo (None: torchft not installed)."""
    bounds = {"workers": workers, "max_tokens": tokens, "max_seconds": max_minutes * 60,
              "eval_batches": EVAL_MAX_BATCHES, "log_every": 0}  # fmt: skip
    if arm == "ddp":
        return run_ddp(cfg, **bounds)
    try:
        from benchmarks.torchft_baseline import run_torchft
    except ImportError as e:
        print(f"== torchft: skipped ({e})", file=sys.stderr, flush=True)
        return None
    return run_torchft(cfg, **bounds)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation, lowest and highest."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def paired_ratios(by_seed: dict[int, dict[str, float]], arm: str, ref: str) -> list[float]:
    return [losses[arm] / losses[ref] for losses in by_seed.values() if arm in losses and ref in losses]


def run_cell(
    workers: int, inner_steps: int, model: str, seeds: list[int], arms: dict[str, list[str] | None], args
) -> dict[str, Any]:
    """Every arm for every seed of one cell: eval losses by seed and arm, and their summaries."""
    by_seed: dict[int, dict[str, float]] = {}
    raw: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        cfg = (
            default_run_config()
            .with_overrides(
                {
                    "data.dataset": args.dataset,
                    "train.inner_steps": inner_steps,
                    "train.seed": seed,
                    "model.init_from": args.init_from,
                    **MODELS[model],
                }
            )  # fmt: skip
            .with_overrides(parse_assignments(args.overrides))
            .validate()
        )
        by_seed[seed] = {}
        with tempfile.TemporaryDirectory(prefix="diloco_quality_") as tmp:
            config_path = Path(tmp) / "run.toml"
            config_path.write_text(cfg.to_toml())
            for arm, flags in arms.items():
                key = f"{arm}/seed{seed}"
                # DDP has no inner steps: its run at any H of this M and model is the same run.
                cell_h = None if arm == "ddp" else inner_steps
                if (old := args.reused.get((workers, cell_h, model), {}).get(key)) is not None:
                    by_seed[seed][arm], raw[key] = old["eval_loss"], old
                    continue
                print(
                    f"== M={workers} H={inner_steps} {model} seed={seed}: {arm}", file=sys.stderr, flush=True
                )
                if flags is None:
                    result = run_peer(arm, cfg, workers, args.tokens, args.max_minutes)
                    if result is None:
                        continue
                else:
                    result = run_diloco(
                        arm, [*flags, "--seed", str(seed)], config_path, args.tokens, workers, Path(tmp),
                        args.max_minutes,
                    )  # fmt: skip
                by_seed[seed][arm] = result["eval_loss"]
                speed = row(arm, result)
                raw[f"{arm}/seed{seed}"] = {
                    **{k: result.get(k)
                       for k in ("eval_loss", "baseline_loss", "tokens_trained", "tokens_merged", "rounds",
                                 "wall_seconds", "trained_tokens_per_s", "learner_tokens_per_s",
                                 "merged_tokens_per_s", "utilization", "budget_wait_share", "cpu_seconds_by_role",
                                 "rounds_by_pushes")},
                    "loop_tokens_per_s": speed["loop_tokens_per_s"],
                    "loop_tokens_per_cpu_s": speed["loop_tokens_per_cpu_s"],
                    "loop_tokens_per_s_outside_budget_waits": speed["loop_tokens_per_s_outside_budget_waits"],
                }  # fmt: skip
    losses = {arm: spread([s[arm] for s in by_seed.values() if arm in s]) for arm in arms}
    ratios = {f"{a}/{b}": spread(r) for a, b in PAIRS if (r := paired_ratios(by_seed, a, b))}
    return {"workers": workers, "inner_steps": inner_steps, "model": model, "eval_loss": losses,
            "ratios": ratios, "by_seed": by_seed, "runs": raw, "speed": speeds(raw, arms, seeds)}  # fmt: skip


SPEEDS = ("loop_tokens_per_s", "loop_tokens_per_cpu_s", "loop_tokens_per_s_outside_budget_waits")


def speeds(raw: dict[str, dict[str, Any]], arms: dict, seeds: list[int]) -> dict[str, Any]:
    """Each arm's training-loop speed over seeds, per wall second and per CPU-second of its
    learners' processes, and every other arm's over torchft's, paired by seed: the wall figure is
    the target's, the CPU one says whether a gap is the loop's or the cores the job's other roles
    (coordinator, data workers) took from the learners on a shared machine."""
    out: dict[str, Any] = {}
    for key in SPEEDS:
        # {seed: {arm: speed}}, the shape paired_ratios reads (arms without the figure left out)
        by_seed = {
            s: {arm: v for arm in arms if (v := (raw.get(f"{arm}/seed{s}") or {}).get(key))} for s in seeds
        }
        out[key] = {
            arm: spread(values)
            for arm in arms
            if (values := [speeds[arm] for speeds in by_seed.values() if arm in speeds])
        }
        out[f"{key}/torchft"] = {
            arm: spread(r)
            for arm in arms
            if arm != "torchft" and (r := paired_ratios(by_seed, arm, "torchft"))
        }
    return out


def print_cell(cell: dict[str, Any]) -> None:
    title = f"M={cell['workers']} H={cell['inner_steps']} model={cell['model']}"
    print(f"\n{title}\n{'-' * len(title)}")
    print(f"{'arm':<22}{'mean':>9}{'std':>9}{'best':>9}{'worst':>9}{'n':>4}")
    for arm, s in cell["eval_loss"].items():
        if s.get("n"):
            print(f"{arm:<22}{s['mean']:>9.4f}{s['std']:>9.4f}{s['min']:>9.4f}{s['max']:>9.4f}{s['n']:>4}")
    for pair, s in cell["ratios"].items():
        print(
            f"{pair:<22}{s['mean']:>9.4f}{s['std']:>9.4f}{s['min']:>9.4f}{s['max']:>9.4f}{s['n']:>4}  (paired by seed)"
        )
    for key in SPEEDS:
        for arm, s in cell["speed"].get(key, {}).items():
            print(f"{arm + ' ' + key:<44}{s['mean']:>10.0f}{s['std']:>9.0f}{s['min']:>9.0f}{s['n']:>4}")
        for arm, s in cell["speed"].get(f"{key}/torchft", {}).items():
            print(f"{arm + ' ' + key + ' / torchft':<44}{s['mean']:>10.4f}{s['std']:>9.4f}{s['min']:>9.4f}"
                  f"{s['n']:>4}  (paired by seed)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="2x50", help="comma-separated MxH: learners x inner steps")
    p.add_argument("--models", default="2layer", help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--arms", default="ddp,sync-diloco,decoupled",
                   help=f"comma-separated, of: {', '.join([*PEER_ARMS, *DILOCO_ARMS])} and --variant names")  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra arm of `diloco run` flags, e.g. tau0='--overlap 0' (repeatable)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=1_228_800, help="token budget per run (all workers)")
    p.add_argument("--dataset", default="stdlib")
    p.add_argument("--init-from", default="", help="start every diloco arm from this model.safetensors")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-minutes", type=float, default=20.0, help="safety bound per run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.json")
    p.add_argument("--reuse", type=Path, action="append", default=[],
                   help="take these arms' runs from an earlier result file instead (repeatable)")  # fmt: skip
    p.add_argument("--reuse-arms", default="ddp,torchft,sync-diloco",
                   help="the arms --reuse takes (their runs must not depend on what changed since)")  # fmt: skip
    args = p.parse_args(argv)
    args.reused = {}
    taken = set(args.reuse_arms.split(","))
    for path in args.reuse:
        for cell in json.loads(path.read_text())["cells"]:
            runs = {
                k: {**v, "reused": str(path)} for k, v in cell["runs"].items() if k.split("/")[0] in taken
            }
            args.reused.setdefault((cell["workers"], cell["inner_steps"], cell["model"]), {}).update(runs)
            ddp = {k: v for k, v in runs.items() if k.startswith("ddp/")}
            args.reused.setdefault((cell["workers"], None, cell["model"]), {}).update(ddp)

    variants = dict(v.split("=", 1) for v in args.variant)
    arms: dict[str, list[str] | None] = {}
    for arm in args.arms.split(","):
        if arm in PEER_ARMS:
            arms[arm] = None
        elif arm in variants:
            arms[arm] = shlex.split(variants[arm])
        else:
            arms[arm] = DILOCO_ARMS[arm]
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = []
    started = time.perf_counter()
    for spec in args.cells.split(","):
        workers, inner_steps = (int(x) for x in spec.lower().split("x"))
        for model in args.models.split(","):
            cells.append(run_cell(workers, inner_steps, model, seeds, arms, args))
            print_cell(cells[-1])
            args.out.parent.mkdir(parents=True, exist_ok=True)
            payload = {"cells": cells, "args": {k: str(v) for k, v in vars(args).items() if k != "reused"},
                       "seconds": time.perf_counter() - started}  # fmt: skip
            args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")  # after every cell
    print(f"\nresults: {args.out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
