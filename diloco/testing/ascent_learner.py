"""A broken learner for hostile-learner runs (diloco.testing.hostile): it joins like any other
(diloco.connect, the run's own model) but climbs the loss instead of descending it (a flipped sign:
the bug, or the attack), at `--lr-scale` times the run's learning rate. Its deltas are finite and
about the honest ones' size: only the coordinator's pusher watch and center clip tell them apart.
With `--lie` it reports the lowest loss it has seen, not the loss it has: what a hostile learner
would do against the watch's loss rule, leaving it to the norm and direction rules.

    python -m diloco.testing.ascent_learner --coordinator HOST:PORT --n-layer 1 --step-delay 0.1
"""

from __future__ import annotations

import argparse
import time

import torch

import diloco
from diloco.config import TrainConfig
from diloco.model import make_inner_optimizer
from diloco.model.gpt import gpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True, help="HOST:PORT")
    parser.add_argument("--n-layer", type=int, default=1, help="the run's model.kwargs.n_layer")
    parser.add_argument("--lr-scale", type=float, default=1.0)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds resting after each step")
    parser.add_argument(
        "--lie", action="store_true", help="report the lowest loss it has seen, not the loss it has (a liar)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    model = gpt(vocab_size=257, n_layer=args.n_layer)
    optimizer = make_inner_optimizer(model, TrainConfig())  # the honest learners' AdamW
    for group in optimizer.param_groups:
        group["lr"] *= args.lr_scale
    with diloco.connect(args.coordinator, model, optimizer) as run:
        print(f"ascent learner {run.worker_id} joined", flush=True)
        lowest = float("inf")
        for batch in run.batches():
            loss = model(batch)
            (-loss).backward()  # the flipped sign
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lowest = min(lowest, loss.item())
            run.step(lowest if args.lie else loss)  # the liar's loss never rises: the loss rule sees nothing
            time.sleep(args.step_delay)
    print(f"{run.worker_id} done after {run.inner_steps} steps: {run.ended_because}", flush=True)


if __name__ == "__main__":
    main()
