"""The built-in GPT through the generic model path, against the same step written directly.

    python benchmarks/model_path.py --steps 200 --repeats 5

The generic path is what a learner runs: a batch of named columns moved to the device, the model's
forward(batch), the loss taken through the contract (diloco.model.contract), then clip and AdamW
(diloco.compute.inner.inner_step). The direct step is what the learner ran before model factories:
logits of x, cross-entropy against y, the same clip and AdamW. Both train the same model on the same
batches, interleaved in blocks so a slow moment of the machine falls on both; the ratio of their
tokens/s is printed with its spread over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.compute.batch import Batch  # noqa: E402
from diloco.compute.inner import inner_step  # noqa: E402
from diloco.config import RunConfig  # noqa: E402
from diloco.model import build_model, lr_at, make_inner_optimizer  # noqa: E402


def direct_step(model, optimizer, rows: torch.Tensor, step: int, cfg: RunConfig) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg.train)
    x, y = rows[:, :-1], rows[:, 1:]
    logits = model.logits(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="steps per block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "model_path.json")
    args = p.parse_args(argv)
    from diloco.config import parse_assignments

    torch.set_num_threads(args.threads)
    cfg = RunConfig().with_overrides(parse_assignments(args.overrides)).validate()
    seq, bs, device = cfg.model.seq_len, cfg.train.batch_size, torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 257, (bs, seq + 1), generator=gen) for _ in range(args.steps)]
    models = {name: build_model(cfg.model, 257, cfg.train.seed) for name in ("direct", "generic")}
    optims = {name: make_inner_optimizer(m, cfg.train) for name, m in models.items()}
    rates: dict[str, list[float]] = {"direct": [], "generic": []}
    # Both start from one init and train the same batches in the same order: at equal tokens
    # their losses must agree (the same loss, not just the same speed).
    losses: dict[str, list[float]] = {"direct": [], "generic": []}
    for repeat in range(args.repeats + 1):  # the first round warms both up and is not counted
        for name in ("direct", "generic") if repeat % 2 else ("generic", "direct"):
            model, opt = models[name], optims[name]
            started = time.perf_counter()
            for i, rows in enumerate(batches):
                if name == "direct":
                    loss = direct_step(model, opt, rows, i, cfg)
                else:
                    batch = Batch.of_shard(
                        {"input_ids": rows}, 0, 0, bs
                    )  # what the learner's prefetcher makes
                    loss, _ = inner_step(model, opt, batch.columns, step=i, train=cfg.train, device=device)
                losses[name].append(loss)
            if repeat:
                rates[name].append(args.steps * bs * seq / (time.perf_counter() - started))
    ratios = [g / d for g, d in zip(rates["generic"], rates["direct"], strict=True)]
    result = {
        "tokens_per_s": {k: statistics.mean(v) for k, v in rates.items()},
        "generic_over_direct": {"mean": statistics.mean(ratios), "min": min(ratios), "max": max(ratios)},
        "repeats": args.repeats, "steps": args.steps, "threads": args.threads, "overrides": args.overrides,
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "max_loss_gap": max(abs(a - b) for a, b in zip(losses["direct"], losses["generic"], strict=True)),
    }  # fmt: skip
    print(f"direct  {result['tokens_per_s']['direct']:>10,.0f} tokens/s")
    print(f"generic {result['tokens_per_s']['generic']:>10,.0f} tokens/s")
    r = result["generic_over_direct"]
    print(
        f"generic / direct: {r['mean']:.4f} (min {r['min']:.4f}, max {r['max']:.4f} over {args.repeats} pairs)"
    )
    print(
        f"loss at equal tokens: direct {result['final_loss']['direct']:.5f}, generic "
        f"{result['final_loss']['generic']:.5f}; largest gap over every step {result['max_loss_gap']:.2e}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
