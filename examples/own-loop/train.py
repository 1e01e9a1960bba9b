"""Your own training loop with diloco: a Hugging Face Llama, your optimizer, your schedule.

    diloco coordinator --workdir runs/own --dataset stdlib &
    diloco data --coordinator 127.0.0.1:PORT &
    python examples/own-loop/train.py --coordinator 127.0.0.1:PORT    # on each learner machine

diloco pushes fragments, applies merges, sends heartbeats and keeps error feedback in the
background; the loop below is all yours.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import diloco

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", required=True, help="HOST:PORT")
parser.add_argument("--worker-id", help="a stable identity: with --state-dir, a restart resumes")
parser.add_argument("--state-dir")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

torch.manual_seed(0)  # the first learner to join offers its init; the others get the global model
config = LlamaConfig(
    vocab_size=257,  # diloco's byte tokens: 256 bytes and end-of-text
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=129,  # a shard row: seq_len + 1 tokens
)
model = LlamaForCausalLM(config)
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
