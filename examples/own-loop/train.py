"""Your own training loop with diloco: a Hugging Face Llama, your optimizer, your schedule.

    export PYTHONPATH=examples/own-loop    # own_model.py: the model, for every diloco command too
    diloco coordinator --workdir runs/own --dataset stdlib --model own_model:llama \
        --set data.chunk_bytes=262144 &   # stdlib as many chunks: several data workers, a held-out split
    diloco data --coordinator 127.0.0.1:PORT &
    python examples/own-loop/train.py --coordinator 127.0.0.1:PORT    # on each learner machine
    diloco eval runs/own    # (and generate, export --format hf): the coordinator named the model

diloco pushes fragments, applies merges, sends heartbeats and keeps error feedback in the
background; the loop below is all yours. The model comes from own_model.py, the factory the
coordinator names (--model): the run's weights are this model's, and every tool that reads them
builds it.
"""

import argparse

import torch
from own_model import llama  # beside this script: Python puts its directory on the path

import diloco

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", required=True, help="HOST:PORT")
parser.add_argument("--worker-id", help="a stable identity: with --state-dir, a restart resumes")
parser.add_argument("--state-dir")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

torch.manual_seed(0)  # the first learner to join offers its init; the others get the global model
model = llama()  # a LlamaForCausalLM: 257 byte tokens, rows of 128 + 1
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

with diloco.connect(
    args.coordinator, model, optimizer, worker_id=args.worker_id, state_dir=args.state_dir
) as run:
    if run.resumed_at_step is not None:  # a restart with the same --worker-id and --state-dir
        print(f"{run.worker_id} resumed at step {run.resumed_at_step}", flush=True)
    elif run.resume_reason:  # a state was kept, but the run no longer accepts it
        print(f"{run.worker_id} started from the global model: {run.resume_reason}", flush=True)
    for batch in run.batches():
        for group in optimizer.param_groups:  # linear warm-up over 20 steps, then constant
            group["lr"] = args.lr * min(1.0, (run.inner_steps + 1) / 20)
        ids = batch["input_ids"]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step(loss)
        if run.inner_steps % 50 == 0:
            print(f"{run.worker_id} step {run.inner_steps} loss {loss.item():.3f}", flush=True)
print(f"{run.worker_id} done after {run.inner_steps} steps: {run.ended_because}", flush=True)
