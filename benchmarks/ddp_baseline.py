"""Classic data-parallel baseline: the built-in GPT trained with torch DDP, to compare diloco with.

Same model, same data, same token budget as a diloco run, but every step all-reduces the full
gradient across N processes (gloo, on loopback). What it measures:

- eval_loss on the held-out chunks, beside the unigram entropy of those rows (the context-free
  baseline);
- tokens_trained = steps * N * batch_size * (seq_len + 1): rows consumed times their length, the
  unit diloco's ledger counts trained tokens in (a row of seq_len + 1 ids gives seq_len targets);
  every step each of the N ranks trains on batch_size distinct rows;
- wire_bytes: the bytes all ranks together SEND for the gradient all-reduce, by the ring
  all-reduce cost model: per bucket of b bytes each rank sends b * 2(N-1)/N (reduce-scatter then
  all-gather), so N ranks send b * 2(N-1). Each byte sent is received once, so bytes received
  equal bytes sent; add them if you want traffic counted at both ends. Gloo may choose another
  algorithm on the real socket; the ring is the bandwidth-optimal reference every all-reduce is
  compared with. DDP's one-time broadcast of rank 0's parameters at start is not counted (every
  rank builds the same model from the seed), nor are the few bytes of the per-step stop flag.
  A diloco run's wire_bytes, which compare.py sets beside these, do count the joins: each
  learner's first full pull and the initial parameters the first learner offers (RPC kinds
  pull_join and init); its summary's steady_wire_bytes_per_token is the figure without them.

Usage:
    python benchmarks/ddp_baseline.py --workers 2 --tokens 200000 --minutes 5 --dataset stdlib \
        --out results.json
"""

# No `from __future__ import annotations` here: DDP checks the comm hook's annotations at runtime
# and rejects them as strings.
import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

# Runnable as a plain script from a checkout: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco.compute.device import pick_device, set_threads
from diloco.config import RunConfig
from diloco.corpus import resolve_dataset
from diloco.data.chunks import lease_positions, partition
from diloco.data.process import process_chunk
from diloco.evaluate import eval_loss, unigram_entropy
from diloco.model import build_model, lr_at, make_inner_optimizer
from diloco.model.contract import loss_and_metrics  # noqa: E402
from diloco.testing.netlab import Machine, enter_namespace
from diloco.tokenizer import load_tokenizer

# The benchmark's own default chunk size: small enough that a short run does not tokenize far more
# of the corpus than it trains on (the library default, 64 MiB, is sized for real datasets).
BENCH_CHUNK_BYTES = 262_144


def build_rows(
    cfg: RunConfig, vocab_size: int, max_train_rows: int | None, max_eval_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Train and eval rows [n, seq_len + 1], made exactly as diloco's data plane makes shards.

    The dataset is partitioned into chunks (some held out for eval) and each chunk is tokenized
    and packed with process_chunk, stopping once there are enough rows: train chunks in the order
    a run's coordinator hands them out (diloco.data.chunks.lease_positions), so a short baseline
    trains on the stretch of corpus a short diloco run does; eval chunks in index order, as the
    run's held-out split is read.
    Train rows are then shuffled with the run's seed (all ranks get the same permutation); eval
    rows stay in order so every run evaluates on the same rows.
    """
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    chunks = partition(resolve_dataset(cfg.data.dataset), cfg.data.chunk_bytes, cfg.data.eval_fraction)
    positions = lease_positions(len(chunks), cfg.train.seed if cfg.data.shuffle else None)
    ranked = sorted(
        zip(chunks, positions, strict=True), key=lambda cp: cp[1] if cp[0].split == "train" else -1
    )
    chunks = [chunk for chunk, _ in ranked]
    wanted = {"train": max_train_rows, "eval": max_eval_rows}
    parts: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
    have = {"train": 0, "eval": 0}
    for chunk in chunks:
        limit = wanted[chunk.split]
        if limit is not None and have[chunk.split] >= limit:
            continue
        rows = process_chunk(chunk, tokenizer, cfg.model.seq_len, cfg.data.text_field).rows
        parts[chunk.split].append(rows)
        have[chunk.split] += len(rows)
    width = cfg.model.seq_len + 1
    train = np.concatenate(parts["train"]) if parts["train"] else np.empty((0, width), np.uint16)
    evals = np.concatenate(parts["eval"]) if parts["eval"] else np.empty((0, width), np.uint16)
    if not len(evals):
        raise ValueError(
            f"no eval rows: {len(chunks)} chunk(s), eval_fraction {cfg.data.eval_fraction}; "
            "lower data.chunk_bytes or raise data.eval_fraction"
        )
    train = train[np.random.default_rng(cfg.train.seed).permutation(len(train))]
    return train, evals[:max_eval_rows]


class _WireCounter:
    """State of the comm hook: gradient bytes this rank handed to all-reduce."""

    def __init__(self) -> None:
        self.bucket_bytes = 0


def _counting_allreduce_hook(
    state: _WireCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    # DDP's default behaviour (average by all-reduce), plus a tally of what went in.
    buf = bucket.buffer()
    state.bucket_bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def _train_rank(
    rank: int,
    world: int,
    port: int,
    cfg: RunConfig,
    train_rows: np.ndarray,
    eval_rows: np.ndarray,
    max_steps: int | None,
    max_seconds: float,
    eval_batches: int,
    result_path: str,
    log_every: int,
    slow_factor: float,
    machines: list[Machine] | None = None,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    if machines:  # each rank on its own machine (diloco.testing.netlab), rank 0's the rendezvous
        enter_namespace(machines[rank].namespace)
        os.environ.update(MASTER_ADDR=machines[0].address, GLOO_SOCKET_IFNAME=machines[rank].device)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # N processes share the machine: split its cores, or they oversubscribe and thrash.
    set_threads(cfg.train.threads if cfg.train.threads > 0 else max(1, cores // world))
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        tokenizer_vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
        model = build_model(cfg.model, tokenizer_vocab, cfg.train.seed).to(device)
        # The GPT has no buffers, so DDP's per-forward buffer broadcast sends nothing uncounted.
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        counter = _WireCounter()
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
        opt = make_inner_optimizer(model, cfg.train)
        bs = cfg.train.batch_size
        steps_per_epoch = len(train_rows) // (world * bs)  # full global batches in the data
        stop = torch.zeros(1, dtype=torch.int32)
        losses: list[float] = []

        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        step = 0
        while max_steps is None or step < max_steps:
            # Ranks must agree on when to stop, or one waits forever in the next all-reduce: rank 0
            # owns the clock and tells the others.
            stop[0] = int(rank == 0 and time.perf_counter() - t0 >= max_seconds)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
            step_started = time.perf_counter()
            lr = lr_at(step, cfg.train)
            for group in opt.param_groups:
                group["lr"] = lr
            # global batch g holds rows [g*bs, (g+1)*bs); rank r takes every N-th batch
            g = (step % steps_per_epoch) * world + rank
            batch = torch.from_numpy(train_rows[g * bs : (g + 1) * bs].astype(np.int64)).to(device)
            loss, _ = loss_and_metrics(ddp({"input_ids": batch}), "the model")
            opt.zero_grad(set_to_none=True)
            loss.backward()  # the gradient all-reduce happens here, bucket by bucket
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            losses.append(loss.item())
            if slow_factor > 1.0 and rank == world - 1:  # an injected straggler, as in diloco run
                time.sleep((slow_factor - 1.0) * (time.perf_counter() - step_started))
            step += 1
            if rank == 0 and log_every > 0 and step % log_every == 0:
                elapsed = time.perf_counter() - t0
                print(
                    json.dumps(
                        {
                            "event": "ddp_step",
                            "step": step,
                            "loss": round(losses[-1], 4),
                            "lr": lr,
                            "elapsed_s": round(elapsed, 2),
                            "steps_per_s": round(step / elapsed, 3),
                        }
                    ),
                    file=sys.stderr,
                    flush=True,
                )
        wall = time.perf_counter() - t0
        cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)

        total = torch.tensor([counter.bucket_bytes], dtype=torch.int64)
        dist.all_reduce(total)  # summed over ranks: N * (bytes per rank)
        dist.all_reduce(cpu)  # every rank's process CPU over the loop
        # Let DDP's reducer go and every rank arrive before the group is torn down: destroying it
        # under a live reducer (or a peer still in a collective) aborts gloo's threads.
        del ddp
        dist.barrier()
    finally:
        dist.destroy_process_group()

    if rank != 0:
        return
    # Each rank sends 2(N-1)/N of what it all-reduces; the sum over ranks is divisible by N.
    wire_bytes = int(total.item()) * 2 * (world - 1) // world
    tokens = step * world * bs * (cfg.model.seq_len + 1)
    result: dict[str, Any] = {
        "mode": "ddp",
        "workers": world,
        "eval_loss": eval_loss(model, eval_rows, bs, device, max_batches=eval_batches),
        "eval_unigram_entropy": unigram_entropy([eval_rows], tokenizer_vocab),
        "eval_rows": min(len(eval_rows), eval_batches * bs),
        "train_loss": float(np.mean(losses[-10:])) if losses else math.nan,
        "tokens_trained": tokens,
        "wall_seconds": wall,
        "wire_bytes": wire_bytes,
        "wire_bytes_per_token": wire_bytes / tokens if tokens else 0.0,
        "steps": step,
        "steps_per_second": step / wall if wall > 0 else 0.0,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        # per CPU-second of the ranks' processes over the loop (diloco's learner_tokens_per_cpu_s)
        "tokens_per_cpu_s": tokens / float(cpu.item()) if cpu.item() > 0 else None,
        "params": sum(p.numel() for p in model.parameters()),
        "epochs": step / steps_per_epoch,
        "batch_size": bs,
        "seq_len": cfg.model.seq_len,
    }
    tmp = result_path + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, result_path)


def _rank_main(rank: int, *args: Any) -> None:
    _train_rank(rank, *args)
    # Past destroy_process_group, gloo's threads can still abort the interpreter's own exit
    # ("terminate called without an active exception", SIGABRT). The work is done and written:
    # leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(main: Any, args: tuple, n: int, bound_s: float, what: str) -> None:
    """`main(i, *args)` in n spawned processes; returns once all are done, raises if one failed
    (the others are terminated) or past bound_s. Every process is reaped, whatever happened."""
    ctx = mp.start_processes(main, args=args, nprocs=n, join=False, start_method="spawn")
    deadline = time.monotonic() + bound_s
    try:
        while not ctx.join(timeout=1.0):  # raises if a process failed; True once all are done
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} ran past {bound_s:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join()


def run_ddp(
    cfg: RunConfig,
    workers: int = 2,
    max_tokens: int | None = None,
    max_seconds: float = 300.0,
    eval_batches: int = 16,
    out: str | Path | None = None,
    log_every: int = 50,
    grace_seconds: float = 120.0,
    slow_factor: float = 1.0,
    machines: list[Machine] | None = None,
) -> dict[str, Any]:
    """Train with DDP over `workers` processes until max_tokens (None: cfg.train.max_tokens; 0: no
    token bound) or max_seconds of training; returns the result dict (also written to `out`).
    `machines`: rank r runs in machines[r]'s network namespace and all-reduces across the lab's
    links (None: every rank on loopback).

    The whole run, processes included, is bounded by max_seconds + grace_seconds; past that every
    rank is killed and TimeoutError raised.
    """
    cfg = cfg.validate()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if machines is not None and len(machines) < workers:
        raise ValueError(f"{workers} ranks need as many machines, not {len(machines)}")
    started = time.perf_counter()
    tokens_budget = cfg.train.max_tokens if max_tokens is None else max_tokens
    bs, seq_len = cfg.train.batch_size, cfg.model.seq_len
    tokens_per_step = workers * bs * (seq_len + 1)
    max_steps = math.ceil(tokens_budget / tokens_per_step) if tokens_budget > 0 else None
    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    train_rows, eval_rows = build_rows(
        cfg, vocab, None if max_steps is None else max_steps * workers * bs, eval_batches * bs
    )
    if len(train_rows) < workers * bs:
        raise ValueError(f"only {len(train_rows)} train rows; one step needs {workers * bs}")
    data_seconds = time.perf_counter() - started

    with tempfile.TemporaryDirectory(prefix="ddp_baseline_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        args = (workers, _free_port(), cfg, train_rows, eval_rows, max_steps, max_seconds, eval_batches,
                result_path, log_every, slow_factor, machines)  # fmt: skip
        run_processes(_rank_main, args, workers, max_seconds + grace_seconds, "DDP baseline")
        result = json.loads(Path(result_path).read_text())

    result["data_seconds"] = data_seconds
    result["total_seconds"] = time.perf_counter() - started
    result["config"] = cfg.to_dict()
    if out is not None:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="run.toml (RunConfig); flags below override it")
    p.add_argument("--workers", type=int, default=2, help="DDP processes")
    p.add_argument(
        "--tokens", type=int, help="token budget over all workers (default: train.max_tokens; 0: none)"
    )
    p.add_argument("--minutes", type=float, default=5.0, help="training time limit")
    p.add_argument("--dataset", help='"stdlib", a directory, glob or file')
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--slow-factor", type=float, default=1.0, help="make the last rank FACTOR× slower")
    # dotted config overrides; None keeps the config's (or the default's) value
    for flag, key, kind in [
        ("--seq-len", "model.seq_len", int),
        ("--n-layer", "model.kwargs.n_layer", int),
        ("--n-head", "model.kwargs.n_head", int),
        ("--n-embd", "model.kwargs.n_embd", int),
        ("--batch-size", "train.batch_size", int),
        ("--lr", "train.lr", float),
        ("--warmup-steps", "train.warmup_steps", int),
        ("--seed", "train.seed", int),
        ("--threads", "train.threads", int),
        ("--device", "train.device", str),
        ("--chunk-bytes", "data.chunk_bytes", int),
        ("--eval-fraction", "data.eval_fraction", float),
        ("--tokenizer", "data.tokenizer", str),
    ]:
        p.add_argument(flag, dest=key, type=kind, metavar=flag[2:].upper(), help=f"overrides {key}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.config:
        cfg = RunConfig.from_toml(args.config)
    else:
        cfg = RunConfig().with_overrides({"data.chunk_bytes": BENCH_CHUNK_BYTES})
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    overrides["data.dataset"] = args.dataset
    cfg = cfg.with_overrides(overrides)
    result = run_ddp(
        cfg,
        workers=args.workers,
        max_tokens=args.tokens,
        max_seconds=args.minutes * 60,
        eval_batches=args.eval_batches,
        out=args.out,
        log_every=args.log_every,
        slow_factor=args.slow_factor,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main()
