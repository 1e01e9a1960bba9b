"""What keeping local state costs a learner of a larger model: tokens/s with and without it.

    python benchmarks/local_state_cost.py --seeds 1,2,3 --out benchmarks/results/local_state_cost.json

A learner copies its state to local disk (diloco.compute.local_state) so that a restart resumes
where it died. The copy grows with the model (parameters, AdamW's moments, each fragment's base,
the push in flight: ~1.7 GB for the 86 M-parameter GPT below), and its cadence is bounded by its
measured cost (diloco.compute.state_cadence, `train.local_state_max_share`). Per seed, in turn
(so that the machine's load falls on every arm alike), `diloco run` with two learners trains the
same tokens with:

  off        no local state (`train.local_state_every_s = 0`)
  budgeted   the default: every 2 s or after a push, within 5% of the time
  unbounded  `train.local_state_max_share = 1`: a copy whenever the last is saved, as before

Printed per arm: the learners' tokens/s in their loops (summary.json's learner_tokens_per_s) over
the same seed's `off`, mean, spread and worst over seeds; and the eval loss, which must not move.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import run_diloco  # noqa: E402
from benchmarks.quality import paired_ratios, spread  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402

# A GPT-2-small shape on short rows: a large state, steps short enough for many pushes.
MODEL = {
    "model.kwargs.n_layer": 12, "model.kwargs.n_head": 12, "model.kwargs.n_embd": 768,
    "model.seq_len": 64, "train.batch_size": 2, "train.inner_steps": 10, "train.warmup_steps": 0,
}  # fmt: skip
ARMS = {
    "off": {"train.local_state_every_s": 0.0},
    "budgeted": {},
    "unbounded": {"train.local_state_max_share": 1.0},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--tokens", type=int, default=12_000)
    p.add_argument("--minutes", type=float, default=4.0, help="each run's time limit")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "local_state_cost.json")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    speed: dict[int, dict[str, float]] = {}
    loss: dict[int, dict[str, float]] = {}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="local-state-cost-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in arms:
                folder = Path(tmp) / f"{arm}-{seed}"
                folder.mkdir()
                config = folder / "run.toml"
                overrides = {**MODEL, "train.seed": seed, **ARMS[arm]}
                config.write_text(default_run_config().with_overrides(overrides).to_toml())
                s = run_diloco(arm, [], config, args.tokens, 2, folder, args.minutes)
                speed.setdefault(seed, {})[arm] = s["learner_tokens_per_s"]
                loss.setdefault(seed, {})[arm] = s["eval_loss"]
                runs.append({"seed": seed, "arm": arm, **{k: s.get(k) for k in (
                    "learner_tokens_per_s", "eval_loss", "wall_seconds", "utilization", "tokens_trained")}})  # fmt: skip
                print(json.dumps(runs[-1]), flush=True)
    report: dict[str, Any] = {"model": MODEL, "tokens": args.tokens, "runs": runs, "over_off": {}}
    for arm in arms:
        if arm == "off" or "off" not in arms:
            continue
        report["over_off"][arm] = {
            "tokens_per_s": spread(paired_ratios(speed, arm, "off")),
            "eval_loss": spread(paired_ratios(loss, arm, "off")),
        }
        t = report["over_off"][arm]["tokens_per_s"]
        e = report["over_off"][arm]["eval_loss"]
        print(
            f"{arm:>10} over off: tokens/s {t['mean']:.3f} ± {t['std']:.3f} (worst {t['min']:.3f}), "
            f"eval loss {e['mean']:.3f} ± {e['std']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")
    return report


if __name__ == "__main__":
    main()
