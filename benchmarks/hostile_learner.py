"""A learner that climbs the loss among honest ones, every role a real process (diloco.testing.hostile):
what each defence saves, side by side and paired by seed.

    python benchmarks/hostile_learner.py --seeds 1,2,3 --out benchmarks/results/hostile_learner.json
    python benchmarks/hostile_learner.py --arms honest,refuse --seeds 1 --lr-scale 0.5
    python benchmarks/hostile_learner.py --arms honest,liar --honest 4 --seeds 1,2    # among four honest

Arms (each once per seed, one after the other): `honest` (the two honest learners alone: the
reference), `named` (the climber beside them, sync.refuse_suspects off: the pusher watch only names
it, the center clip bounds each push), `refuse` (its pushes refused while named: the default),
`bare` (no center clip, nothing refused), `liar` (as `refuse`, the climber reporting the lowest
loss it has seen: the loss rule sees nothing, the norm and direction rules are left). The climber is user code through diloco.connect
with a valid identity: finite deltas of about the honest ones' size, pointing up the loss.
benchmarks/outer_sim.py's hostile learner pushes its delta reversed instead; this one is what a
flipped sign in a real learner does to a real run. Printed per arm: held-out loss (mean, spread,
worst), after how many of its pushes the climber was first refused, how many of its pushes merged,
pushes clipped, and whether an honest learner was ever named or an audit failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.testing.hostile import HostileRun, run  # noqa: E402
from tests.support import copy_corpus  # noqa: E402

ARMS: dict[str, dict[str, Any]] = {
    "honest": {"ascent": 0},
    "named": {"overrides": ("sync.refuse_suspects=false",)},
    "refuse": {"overrides": ("sync.refuse_suspects=true",)},
    "bare": {"overrides": ("sync.refuse_suspects=false", "sync.center_clip=0")},
    "liar": {"overrides": ("sync.refuse_suspects=true",), "lie": True},
}


def climber_figures(got: dict[str, Any]) -> dict[str, Any]:
    """The climber's pushes: merged, refused while named, and how many it made before the first
    refusal (None: never refused)."""
    mine = [v for w, v in got["learners"].items() if w in got["ascent_ids"]]
    if not mine:
        return {}
    return {
        "merged": mine[0]["merged"],
        "merged_after_refused": mine[0]["merged_after_refused"],
        "refused": mine[0]["refused_named"],
        "pushes_before_refused": mine[0].get("pushes_before_refused"),
        "named": bool(set(got["named"]) & set(got["ascent_ids"])),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"of: {', '.join(ARMS)}")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--tokens", type=int, default=HostileRun.tokens, help="the merged-token budget")
    p.add_argument("--lr-scale", type=float, default=1.0, help="the climber's learning rate over the run's")
    p.add_argument("--honest", type=int, default=HostileRun.honest, help="honest learners beside the climber")
    p.add_argument("--set", action="append", default=[], help="section.key=value for every arm")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict[str, Any]]] = {a: {} for a in arms}
    with tempfile.TemporaryDirectory(prefix="diloco_hostile_") as tmp:
        text = Path(tmp) / "corpus"
        text.mkdir()
        copy_corpus(text, 1_500_000)  # the tests' small corpus: Python's own source as text
        for seed in seeds:  # arms side by side within a seed: the machine's hour moves them alike
            for arm in arms:
                spec = HostileRun(
                    ascent=ARMS[arm].get("ascent", 1),
                    lie=ARMS[arm].get("lie", False),
                    honest=args.honest,
                    lr_scale=args.lr_scale,
                    tokens=args.tokens,
                    seed=seed,
                    overrides=(*ARMS[arm].get("overrides", ()), *args.set),
                )
                got = run(Path(tmp) / f"{arm}-{seed}", text, spec)
                got["climber"] = climber_figures(got)
                runs[arm][seed] = got
                print(f"{arm} seed {seed}: eval {got['eval_loss']:.3f} (unigram {got['baseline_loss']:.3f}), "
                      f"climber {got['climber'] or '-'}, clipped {got['pushes_center_clipped']}, "
                      f"honest named {got['honest_named'] or 'none'}, audit {'ok' if got['audit_ok'] else 'FAILED'}, "
                      f"{got['wall_s']:.0f} s", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for arm in arms:
        evals = [runs[arm][s]["eval_loss"] for s in seeds]
        summary[arm] = {
            "eval_mean": statistics.fmean(evals),
            "eval_sd": statistics.stdev(evals) if len(evals) > 1 else 0.0,
            "eval_worst": max(evals),
            "climber_first_refused_after": [
                runs[arm][s]["climber"].get("pushes_before_refused") for s in seeds
            ],
            "climber_merged": [runs[arm][s]["climber"].get("merged") for s in seeds],
            "honest_named": sum(bool(runs[arm][s]["honest_named"]) for s in seeds),
            "audits_ok": all(runs[arm][s]["audit_ok"] for s in seeds),
        }
        if "honest" in arms and arm != "honest":
            summary[arm]["eval_over_honest"] = [
                runs[arm][s]["eval_loss"] / runs["honest"][s]["eval_loss"] for s in seeds
            ]
        line = summary[arm]
        print(f"{arm:8s} eval {line['eval_mean']:.3f} ± {line['eval_sd']:.3f} (worst {line['eval_worst']:.3f}); "
              f"climber refused after {line['climber_first_refused_after']}, merged {line['climber_merged']}; "
              f"honest named in {line['honest_named']} runs; audits {'ok' if line['audits_ok'] else 'FAILED'}")  # fmt: skip
    if args.out:
        result = {"command": " ".join(["python benchmarks/hostile_learner.py", *(argv or sys.argv[1:])]),
                  "lr_scale": args.lr_scale, "tokens": args.tokens, "honest": args.honest, "summary": summary,
                  "runs": {a: {str(s): r for s, r in by.items()} for a, by in runs.items()}}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
