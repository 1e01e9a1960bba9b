"""The pusher watch's bars against honest runs and a hostile learner (coordinator/pusher_watch.py).

    python benchmarks/pusher_watch.py --out benchmarks/results/pusher_watch.json
    python benchmarks/pusher_watch.py --honest gpt4_h10,digits3 --scales 1.0,2.9 --seeds 1
    python benchmarks/pusher_watch.py --refuse-suspects --honest '' --out benchmarks/results/pusher_watch_refuse.json

Honest: real `diloco run`s (GPT at H = 10 and 20, a 3× slower learner, int8 pushes, synchronous
DiLoCo, learners killed under chaos, the digits CNN with and without BatchNorm), each learner's
nearest approach to each bar as the coordinator kept it (the run's summary), and whether anyone was
named. Hostile: benchmarks/outer_sim.py, 3 learners, one pushing its own delta reversed at each
--scales × the others' median norm, per seed: the eval loss, whether it was named and after how many
of its pushes, and whether an honest learner was named. Printed: the honest maxima beside the bars,
and each attack's outcome. --refuse-suspects runs every arm with `sync.refuse_suspects` (a named
learner's pushes refused while it is named): what that saves under attack, and what it costs
honest runs (each learner's refused pushes). --center-clips 0,2 runs every arm once per
`sync.center_clip` bound, side by side (coordinator/centered_clip.py): the honest runs' pushes
clipped and their deviation ratios (the figure the bound is compared with, from each run's ledger),
and the eval under attack.

    python benchmarks/pusher_watch.py --refuse-suspects --center-clips 0,2 --honest gpt4_h10,digits3 \
        --scales 0,1.0,2.5,9.9 --out benchmarks/results/center_clip.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loss_replay import replay  # noqa: E402
from benchmarks.norm_ratios import push_ratios, summary  # noqa: E402
from diloco.config import RunConfig  # noqa: E402
from diloco.coordinator.pusher_watch import (  # noqa: E402
    SUSPECT_DISAGREEMENT,
    SUSPECT_GAP,
    SUSPECT_LOSS,
    SUSPECT_RATIO,
)

GPT = ["--set", "train.inner_steps=10"]
HONEST: dict[str, list[str]] = {
    "gpt4_h10": ["--learners", "4", "--tokens", "600000", *GPT],
    "gpt4_int8": [
        "--learners",
        "4",
        "--codec",
        "int8",
        "--pull-codec",
        "int8",
        "--tokens",
        "600000",
        "--set",
        "train.inner_steps=20",
    ],  # fmt: skip
    "gpt3_slow": ["--learners", "3", "--slow-learner", "3", "--tokens", "1500000", *GPT],
    "gpt4_sync": ["--learners", "4", "--sync", "--tokens", "1500000", *GPT],
    "gpt4_chaos": [
        "--learners",
        "4",
        "--tokens",
        "800000",
        "--chaos-interval",
        "8",
        "--chaos-roles",
        "learner",
        "--minutes",
        "3",
        *GPT,
    ],  # fmt: skip
    "digits3": ["--config", "examples/digits/run.toml", "--learners", "3"],
    "digits3_bn": [
        "--config",
        "examples/digits/run.toml",
        "--learners",
        "3",
        "--set",
        "model.kwargs.batchnorm=true",
    ],
}


def honest_run(
    name: str, flags: list[str], workdir: Path, images: Path, refuse: bool, clip: float = 0.0
) -> dict[str, Any]:
    """One honest run: each learner's nearest approach to the bars, who was named, and how many
    pushes the centered clip pulled in (with the deviation ratios it compared)."""
    data = ["--dataset", str(images)] if "examples/digits/run.toml" in flags else []
    cmd = [sys.executable, "-m", "cli", "run", "--workdir", str(workdir), "--no-progress",
           "--set", "eval.every_s=0", "--set", f"sync.refuse_suspects={str(refuse).lower()}",
           "--set", f"sync.center_clip={clip:g}", *flags, *data]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    run = json.loads((workdir / "summary.json").read_text())
    detail = run["learners_detail"].values()
    inner_steps = RunConfig.from_toml(workdir / "run.toml").train.inner_steps
    return {
        "eval_loss": run["eval_loss"],
        "named": run.get("suspect_learners") or {},
        "kills": run.get("kills") or {},
        "highest_ratio": max((d.get("delta_norm_ratio_highest") or 0.0 for d in detail), default=0.0),
        "largest_gap": max((d.get("delta_alignment_gap_largest") or 0.0 for d in detail), default=0.0),
        "highest_loss_excess": max((d.get("loss_excess_highest") or 0.0 for d in detail), default=0.0),
        "largest_disagreement": max(
            (d.get("delta_disagreement_largest") or 0.0 for d in detail), default=0.0
        ),
        # The loss rule's figure replayed from the ledger both ways (benchmarks/loss_replay.py).
        "loss_excess_replayed": replay(workdir),
        "alignments": [d.get("delta_alignment") for d in detail],
        "pushes_refused": run.get("pushes_refused"),
        "pushes_center_clipped": run.get("pushes_center_clipped"),
        "deviation_ratios": summary(
            push_ratios(workdir / "state" / "ledger.sqlite", inner_steps, "deviation")
        ),
    }


def hostile_run(scale: float, seed: int, out: Path, refuse: bool, clip: float = 0.0) -> dict[str, Any]:
    """outer_sim with learner 2 pushing its delta reversed at `scale` × the others' median."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "outer_sim.py"), "--learners", "3", "--quorum", "0",
           "--inner-steps", "20", "--seed", str(seed), "--out", str(out),
           "--set", f"sync.refuse_suspects={str(refuse).lower()}", "--set", f"sync.center_clip={clip:g}"]  # fmt: skip
    if scale > 0:
        cmd += ["--hostile", "2", "--attack-scale", str(scale)]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
    result = json.loads(out.read_text())
    hostile = result["watch"][2]
    return {
        "eval_loss": result["eval_loss"],
        "hostile_named_after_pushes": hostile["flagged_after_pushes"] if scale > 0 else None,
        "hostile_reason": hostile["suspect"] if scale > 0 else "",
        "honest_named": result["wrongly_flagged"],
        "highest_ratio": [w["delta_norm_ratio_highest"] for w in result["watch"]],
        "largest_gap": [w["delta_alignment_gap_largest"] for w in result["watch"]],
        "refused_by_learner": result["refused_by_learner"],
        "center_clipped": result["center_clipped"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--honest", default=",".join(HONEST), help=f"of: {', '.join(HONEST)} ('' for none)")
    p.add_argument("--scales", default="0,1.0,1.9,2.5,2.9,9.9", help="attack scales; 0: no attacker")
    p.add_argument("--seeds", default="1,2", help="the attack runs' seeds")
    p.add_argument(
        "--honest-seeds", default="1", help="train.seed of each honest run (each config once per seed)"
    )
    p.add_argument("--refuse-suspects", action="store_true", help="every arm with sync.refuse_suspects")
    p.add_argument("--center-clips", default=f"{RunConfig().sync.center_clip:g}",
                   help="sync.center_clip bounds, each arm once per bound (default: the coordinator's)")  # fmt: skip
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    clips = [float(c) for c in args.center_clips.split(",")]
    results: dict[str, Any] = {
        "bars": {
            "ratio": SUSPECT_RATIO,
            "gap": SUSPECT_GAP,
            "loss_excess": SUSPECT_LOSS,
            "disagreement": SUSPECT_DISAGREEMENT,
        },
        "refuse_suspects": args.refuse_suspects,
        "center_clips": clips,
        "honest": {},
        "hostile": {},
    }
    with tempfile.TemporaryDirectory(prefix="diloco_watch_") as tmp:
        images = Path(tmp) / "images"
        if any(n.startswith("digits") for n in args.honest.split(",") if n):
            subprocess.run([sys.executable, str(ROOT / "examples/digits/prepare.py"), str(images)], check=True,
                           capture_output=True)  # fmt: skip
        honest_seeds = [int(s) for s in args.honest_seeds.split(",")]
        for name, seed, clip in itertools.product(filter(None, args.honest.split(",")), honest_seeds, clips):
            # side by side: the arms of one config and seed run one after the other
            key = name + ("" if len(honest_seeds) == 1 else f"/seed{seed}")
            key += "" if len(clips) == 1 else f"/clip{clip:g}"
            flags = [*HONEST[name], "--set", f"train.seed={seed}"]
            results["honest"][key] = got = honest_run(
                name, flags, Path(tmp) / key.replace("/", "_"), images, args.refuse_suspects, clip
            )
            print(f"honest {key}: eval {got['eval_loss']:.4f}, highest ratio {got['highest_ratio']:.2f}, "
                  f"largest gap {got['largest_gap']:.3f}, largest disagreement {got['largest_disagreement']:.3f}, highest loss excess {got['highest_loss_excess']:.3f} (replayed {got['loss_excess_replayed']}), named {list(got['named']) or 'nobody'}, "
                  f"clipped {got['pushes_center_clipped']}, deviation ratios {got['deviation_ratios']}",
                  flush=True)  # fmt: skip
        for scale in (float(s) for s in args.scales.split(",") if s):
            for seed in (int(s) for s in args.seeds.split(",")):
                for clip in clips:
                    key = f"{scale:g}x/seed{seed}" + ("" if len(clips) == 1 else f"/clip{clip:g}")
                    out = Path(tmp) / f"sim_{key.replace('/', '_')}.json"
                    results["hostile"][key] = got = hostile_run(scale, seed, out, args.refuse_suspects, clip)
                    print(f"reversed at {key}: eval {got['eval_loss']:.3f}, hostile named after "
                          f"{got['hostile_named_after_pushes']} pushes, honest named {got['honest_named']}, "
                          f"refused by learner {got['refused_by_learner']}, clipped {got['center_clipped']}",
                          flush=True)  # fmt: skip
    honest = results["honest"].values()
    if honest:
        print(f"honest maxima: ratio {max(h['highest_ratio'] for h in honest):.2f} (bar {SUSPECT_RATIO:g}), "
              f"gap {max(h['largest_gap'] for h in honest):.3f} (bar {SUSPECT_GAP:g}), "
              f"loss excess {max(h['highest_loss_excess'] for h in honest):.3f} (bar {SUSPECT_LOSS:g}), "
              f"disagreement {max(h['largest_disagreement'] for h in honest):.3f} (bar {SUSPECT_DISAGREEMENT:g})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
