"""Eval loss of each codec against fp32 at equal tokens, seed by seed: a paired comparison.

    python benchmarks/codec_loss.py --inner-steps 500 --rounds 6 --seeds 3 --codecs fp32,int4

Synchronous DiLoCo, M learners, in one process, built from the library's own parts: each learner
has its own AdamW and its own seeded stream of rows; its delta is encoded with error feedback
(`codecs.encode_with_feedback`, as the learner does), decoded, merged (`merging.merge_weights`,
`merging.merge`) and applied with the outer Nesterov step (`merging.outer_step`), and the merged
fragment goes back encoded against what the learners hold (`codecs.encode_step`, as the
coordinator does). Within one seed every codec sees the very same rows in the very same order and
starts from the same weights, so the difference between arms is the codec's alone. (An
end-to-end run also differs by which learner happened to lease which shard; at H = 500 that
moves eval loss by more than the 2% under test, so a pair of `diloco run`s cannot show it.)

Printed: eval loss of the global model per seed and codec, each codec's ratio to fp32 of the
same seed, and the mean and worst ratio. Results go to a JSON file too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_baseline import BENCH_CHUNK_BYTES, build_rows  # noqa: E402
from diloco.compute.device import set_threads  # noqa: E402
from diloco.config import RunConfig, parse_assignments  # noqa: E402
from diloco.coordinator import merging  # noqa: E402
from diloco.evaluate import eval_loss  # noqa: E402
from diloco.local.evaluation import EVAL_MAX_BATCHES  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.model import build_model, lr_at, make_inner_optimizer  # noqa: E402
from diloco.model.contract import loss_and_metrics  # noqa: E402
from diloco.model.weights import check_matches, load_weights  # noqa: E402
from diloco.tokenizer import load_tokenizer  # noqa: E402
from diloco.wire import codecs  # noqa: E402


def load_into(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])


def train_arm(
    cfg: RunConfig,
    codec: str,
    start: dict[str, torch.Tensor],
    streams: list[np.ndarray],
    vocab: int,
    rounds: int,
) -> dict[str, torch.Tensor]:
    """`rounds` rounds of synchronous DiLoCo; returns the global parameters at the end."""
    t, s = cfg.train, cfg.sync
    learners = []
    for _ in streams:
        model = build_model(cfg.model, vocab, t.seed)
        learners.append({"model": model, "opt": make_inner_optimizer(model, t), "residual": {}, "row": 0})
    global_params = {n: v.clone().float() for n, v in start.items()}
    momentum = {n: torch.zeros_like(v) for n, v in global_params.items()}
    held = {n: v.clone() for n, v in global_params.items()}  # what every learner holds
    for r in range(rounds):
        deltas, tokens, steps = [], [], []
        for learner, rows in zip(learners, streams, strict=True):
            model, opt = learner["model"], learner["opt"]
            load_into(model, held)
            for step in range(t.inner_steps):
                for group in opt.param_groups:
                    group["lr"] = lr_at(r * t.inner_steps + step, t)
                at = learner["row"]
                batch = torch.from_numpy(rows[at : at + t.batch_size].astype(np.int64))
                learner["row"] = at + t.batch_size
                loss, _ = loss_and_metrics(model({"input_ids": batch}), "the model")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                opt.step()
            delta = {}
            for name, p in model.named_parameters():
                d = held[name] - p.detach()
                if codec != "fp32":  # the learner's push and the coordinator's decode
                    blob, learner["residual"][name] = codecs.encode_with_feedback(
                        d, codec, learner["residual"].get(name), s.codec_level
                    )
                    d = codecs.decode(blob, codec, tuple(d.shape))
                delta[name] = d
            deltas.append(delta)
            tokens.append(t.inner_steps * t.batch_size * rows.shape[1])
            steps.append(t.inner_steps)
        weights = merging.merge_weights(tokens, steps, s.merge)
        outer_grad = merging.merge(deltas, weights, s.merge, consume=True)
        lr, mu = merging.outer_hyper(
            s.outer_lr, s.outer_momentum, s.outer_warmup_rounds, r
        )  # the syncer's rule
        global_params, momentum = merging.outer_step(
            global_params, momentum, outer_grad, lr, mu, s.nesterov, consume=True
        )
        if codec == "fp32":
            held = {n: v.clone() for n, v in global_params.items()}
        else:  # the way back, encoded against what learners hold
            held = {
                n: codecs.encode_step(v, held[n], codec, s.codec_level)[1] for n, v in global_params.items()
            }
    return global_params


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", default="fp32,int4", help="comma-separated; fp32 is always included")
    p.add_argument("--inner-steps", type=int, default=500, help="H")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--init-from", type=Path, help="start every arm from these weights (safetensors)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "codec_loss.json")
    args = p.parse_args(argv)
    names = ["fp32"] + [c for c in args.codecs.split(",") if c and c != "fp32"]
    for c in names:
        if c not in codecs.CODECS:
            p.error(f"unknown codec {c!r}; one of {', '.join(codecs.CODECS)}")
    if args.threads:
        set_threads(args.threads)

    base = default_run_config().with_overrides(
        {
            "train.inner_steps": args.inner_steps,
            "train.batch_size": args.batch_size,
            "data.chunk_bytes": BENCH_CHUNK_BYTES,
            **parse_assignments(args.set),
        }
    )
    vocab = base.model.vocab_size or load_tokenizer(base.data.tokenizer).vocab_size
    need = args.rounds * args.inner_steps * args.batch_size * args.learners
    train_rows, eval_rows = build_rows(base, vocab, need, EVAL_MAX_BATCHES * args.batch_size)
    if len(train_rows) < need:
        p.error(f"{args.rounds} rounds need {need} train rows, the dataset has {len(train_rows)}")
    tokens = need * train_rows.shape[1]
    print(
        f"sync DiLoCo, {args.learners} learners, H = {args.inner_steps}, {args.rounds} rounds, "
        f"batch {args.batch_size}: {tokens:,} tokens per arm; {len(eval_rows)} eval rows",
        flush=True,
    )

    runs: list[dict[str, Any]] = []
    for k in range(args.seeds):
        seed = base.train.seed + k
        cfg = base.with_overrides({"train.seed": seed})
        # This seed's rows, dealt to the learners; every codec of the seed gets the same streams.
        order = np.random.default_rng(seed).permutation(len(train_rows))[:need]
        streams = [train_rows[order[i :: args.learners]] for i in range(args.learners)]
        start_model = build_model(cfg.model, vocab, seed)
        start = {n: v.detach().clone() for n, v in start_model.named_parameters()}
        if args.init_from:  # the same weights for every seed: the seeds differ in data order
            loaded = load_weights(str(args.init_from))
            check_matches(start, loaded, str(args.init_from))
            start = {n: loaded[n].float() for n in start}
        for codec in names:
            started = time.monotonic()
            final = train_arm(cfg, codec, start, streams, vocab, args.rounds)
            load_into(start_model, final)
            loss = eval_loss(start_model, eval_rows, args.batch_size, "cpu", max_batches=EVAL_MAX_BATCHES)
            runs.append(
                {"seed": seed, "codec": codec, "eval_loss": loss, "seconds": time.monotonic() - started}
            )
            print(f"seed {seed} {codec:5s} eval {loss:.4f}  ({runs[-1]['seconds']:.0f} s)", flush=True)

    fp32 = {r["seed"]: r["eval_loss"] for r in runs if r["codec"] == "fp32"}
    summary = {}
    print(f"\n{'codec':6s} {'mean eval':>10s} {'mean ratio':>11s} {'worst ratio':>12s}  per seed")
    for codec in names:
        mine = [r for r in runs if r["codec"] == codec]
        ratios = [r["eval_loss"] / fp32[r["seed"]] for r in mine]
        summary[codec] = {
            "mean_eval_loss": float(np.mean([r["eval_loss"] for r in mine])),
            "mean_ratio": float(np.mean(ratios)),
            "worst_ratio": float(max(ratios)),
            "ratios": ratios,
        }
        per_seed = ", ".join(f"{x - 1:+.2%}" for x in ratios)
        print(
            f"{codec:6s} {summary[codec]['mean_eval_loss']:10.4f} {summary[codec]['mean_ratio'] - 1:+11.2%} "
            f"{summary[codec]['worst_ratio'] - 1:+12.2%}  {per_seed}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "inner_steps": args.inner_steps,
                "rounds": args.rounds,
                "learners": args.learners,
                "batch_size": args.batch_size,
                "tokens_per_arm": tokens,
                "init_from": str(args.init_from) if args.init_from else None,
                "runs": runs,
                "summary": summary,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
