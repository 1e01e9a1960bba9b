"""Peer baseline: torchft's own DiLoCo (torchft.local_sgd.DiLoCo) on the same model and rows as DDP.

N replica groups of one rank each, each its own process, coordinated by a torchft Lighthouse; each
runs the same inner loop as a diloco learner (AdamW from make_inner_optimizer, lr_at warmup, grad
clip) and every train.inner_steps (H) steps all-reduces its pseudo-gradient over gloo and applies
the outer SGD (sync.outer_lr, sync.outer_momentum, Nesterov). It is synchronous DiLoCo with one
fragment, the counterpart of compare.py's sync-diloco arm. What it measures:

- eval_loss of replica 0's model after the last outer step, on ddp_baseline's eval rows, beside
  their unigram entropy;
- tokens_trained = steps * N * batch_size * (seq_len + 1), ddp_baseline's unit. Runs stop only at
  a round boundary (so everything trained is merged): the token budget is rounded up to whole
  rounds of H steps, and the time limit is checked after each round;
- wire_bytes: the bytes all replicas SEND for their all-reduces (pseudo-gradients, plus a 4-byte
  stop flag per round), by ddp_baseline's ring cost model: a replica handing b bytes to all-reduce
  sends b * 2(N-1)/N. Not counted: torchft's gRPC quorum, should_commit and heartbeat traffic
  (lighthouse and manager servers) and the TCPStore rendezvous.

Everything binds 127.0.0.1: the lighthouse, each replica's TCPStore (a socket we bind and hand
over), its ManagerServer (torchft hardcodes "[::]", so its constructor is wrapped) and gloo
(GLOO_SOCKET_IFNAME=lo). torchft's HTTP checkpoint server (for healing a replica that fell behind)
would bind every interface; this fault-free baseline never heals, so it gets a transport that
refuses to.

Usage:
    python benchmarks/torchft_baseline.py --workers 2 --tokens 300000 --set model.kwargs.n_layer=2
"""

import argparse
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# torchft's Rust logger reads RUST_LOG once, when the extension is imported; its INFO level prints
# a line per quorum tick. Quiet by default, and inherited by the spawned replicas.
os.environ.setdefault("RUST_LOG", "warn")

import numpy as np
import torch
import torch.distributed as dist
import torchft.manager
from torch.distributed import ReduceOp
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing import CheckpointTransport
from torchft.coordination import LighthouseServer
from torchft.local_sgd import DiLoCo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ddp_baseline import BENCH_CHUNK_BYTES, build_rows, run_processes
from diloco.compute.device import pick_device, set_threads
from diloco.config import RunConfig, parse_assignments
from diloco.evaluate import eval_loss, unigram_entropy
from diloco.model import build_model, lr_at, make_inner_optimizer
from diloco.model.contract import loss_and_metrics  # noqa: E402
from diloco.tokenizer import load_tokenizer

LOOPBACK = "127.0.0.1"
_ManagerServer = torchft.manager.ManagerServer


def _loopback_manager_server(**kwargs: Any) -> Any:
    # Manager builds its ManagerServer with bind=f"[::]:{port}" (every interface); keep it on loopback.
    return _ManagerServer(**{**kwargs, "bind": f"{LOOPBACK}:0"})


class _NoHealTransport(CheckpointTransport[Any]):
    """Stands in for HTTPTransport, whose server listens on every interface. Healing only happens
    when a replica is behind the others' step; in this fault-free run none ever is."""

    def metadata(self) -> str:
        return "no-heal"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        raise RuntimeError(f"torchft baseline does not heal (replicas {dst_ranks} asked at step {step})")

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        raise RuntimeError(f"torchft baseline does not heal (from replica {src_rank} at step {step})")


def _train_replica(
    replica: int,
    world: int,
    lighthouse: str,
    cfg: RunConfig,
    max_steps: int | None,
    max_seconds: float,
    eval_batches: int,
    result_dir: str,
    log_every: int,
    slow_factor: float,
    timeout_s: float,
) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, GLOO_SOCKET_IFNAME="lo")
    torchft.manager.ManagerServer = _loopback_manager_server  # type: ignore[misc]
    train_rows = np.load(Path(result_dir, "train.npy"), mmap_mode="r")
    eval_rows = np.load(Path(result_dir, "eval.npy"))
    # Its warning per quorum that NCCL's flight recorder cannot be reset is noise on gloo.
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    set_threads(cfg.train.threads if cfg.train.threads > 0 else max(1, cores // world))
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", replica % torch.cuda.device_count())
        torch.cuda.set_device(device)

    # The replica group's TCPStore: torchft's Manager only connects to one, and the quorum hands
    # its address to the other replicas for gloo's rendezvous. TCPStore itself would bind every
    # interface, so it gets a socket already bound to loopback (kept referenced: it owns the fd).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, None, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.fileno())  # fmt: skip
    # Synchronous (min_replica_size = N; DiLoCo needs use_async_quorum=False); init_sync off, as
    # every replica builds the same initial model from the seed; the replica id's trailing digits
    # become its global rank. A fast replica waits in the quorum for the slowest one's whole round.
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=world, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timedelta(seconds=max_seconds + timeout_s), connect_timeout=timeout,
                      rank=0, world_size=1, store_addr=LOOPBACK, store_port=port, lighthouse_addr=lighthouse,
                      replica_id=f"replica_{replica}", hostname=LOOPBACK,
                      checkpoint_transport=_NoHealTransport(), init_sync=False)  # fmt: skip
    sent = [0]  # bytes this replica handed to all-reduce
    allreduce = manager.allreduce

    def counting_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counting_allreduce  # type: ignore[method-assign]

    def agree_stop(mine: bool) -> bool:
        # Replicas must stop after the same round, or the others wait in the next quorum until it
        # times out: a SUM all-reduce of everyone's vote (only replica 0 votes: it owns the clock).
        flag = torch.tensor([float(mine)], device=device)
        manager.allreduce(flag, reduce_op=ReduceOp.SUM).wait()
        return flag.item() > 0

    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    model = build_model(cfg.model, vocab, cfg.train.seed).to(device)
    inner = make_inner_optimizer(model, cfg.train)
    momentum = cfg.sync.outer_momentum
    outer = torch.optim.SGD(model.parameters(), lr=cfg.sync.outer_lr, momentum=momentum,
                            nesterov=cfg.sync.nesterov and momentum > 0)  # fmt: skip
    H, bs = cfg.train.inner_steps, cfg.train.batch_size
    steps_per_epoch = len(train_rows) // (world * bs)
    losses: list[float] = []
    sync_s = 0.0
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H):
            # A first quorum (all N replicas, gloo rendezvous) and all-reduce: the start barrier,
            # as DDP's init_process_group + barrier, so start-up skew is not timed.
            manager.start_quorum()
            agree_stop(False)
            sent[0] = 0
            t0, cpu0 = time.time(), time.process_time()
            step = 0
            while max_steps is None or step < max_steps:
                started = time.perf_counter()
                lr = lr_at(step, cfg.train)
                for group in inner.param_groups:
                    group["lr"] = lr
                # the rows ddp_baseline's rank `replica` takes: every N-th global batch
                g = (step % steps_per_epoch) * world + replica
                batch = torch.from_numpy(train_rows[g * bs : (g + 1) * bs].astype(np.int64)).to(device)
                loss, _ = loss_and_metrics(model({"input_ids": batch}), "the model")
                inner.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                if slow_factor > 1.0 and replica == world - 1:  # an injected straggler, as in diloco run
                    time.sleep((slow_factor - 1.0) * (time.perf_counter() - started))
                step += 1
                stepped = time.perf_counter()
                inner.step()  # on every H-th step DiLoCo's post-hook runs quorum, all-reduce, outer step
                losses.append(loss.item())
                if step % H == 0:
                    sync_s += time.perf_counter() - stepped
                    if agree_stop(replica == 0 and time.time() - t0 >= max_seconds):
                        break
                if replica == 0 and log_every > 0 and step % log_every == 0:
                    elapsed = time.time() - t0
                    print(json.dumps({"event": "torchft_step", "step": step, "loss": round(losses[-1], 4),
                                      "lr": lr, "elapsed_s": round(elapsed, 2),
                                      "rounds_committed": manager.current_step()}),
                          file=sys.stderr, flush=True)  # fmt: skip
            t1, cpu_s = time.time(), time.process_time() - cpu0
            if manager.errored():
                raise RuntimeError(f"replica {replica}: torchft reported {manager.errored()}")
        part: dict[str, Any] = {
            "replica": replica,
            "steps": step,
            "start": t0,
            "end": t1,
            "cpu_seconds": cpu_s,
            "sent_bytes": sent[0],
            "sync_seconds": sync_s,
            "rounds_committed": manager.current_step(),
            "train_loss": float(np.mean(losses[-10:])) if losses else math.nan,
        }
        if replica == 0:  # replica 0's parameters are the global ones after the last outer step
            part["eval_loss"] = eval_loss(model, eval_rows, bs, device, max_batches=eval_batches)
            part["params"] = sum(p.numel() for p in model.parameters())
    finally:
        manager.shutdown(wait=False)
    del store
    path = Path(result_dir, f"replica{replica}.json")
    path.with_suffix(".tmp").write_text(json.dumps(part))
    os.replace(path.with_suffix(".tmp"), path)


def _replica_main(replica: int, *args: Any) -> None:
    _train_replica(replica, *args)
    # As in ddp_baseline: gloo's and torchft's threads can abort the interpreter's own exit. The
    # work is written; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_torchft(cfg: RunConfig, workers: int = 2, max_tokens: int | None = None, max_seconds: float = 300.0,
                eval_batches: int = 16, log_every: int = 0, out: str | Path | None = None,
                grace_seconds: float = 120.0, slow_factor: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """Train with torchft DiLoCo over `workers` replica processes until max_tokens (None:
    cfg.train.max_tokens; 0: no token bound; rounded up to whole rounds) or max_seconds (checked
    after each round); returns the result dict (also written to `out`).

    The whole run is bounded by max_seconds + grace_seconds; past that every replica is killed,
    the lighthouse stopped and TimeoutError raised.
    """
    cfg = cfg.validate()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = time.perf_counter()
    budget = cfg.train.max_tokens if max_tokens is None else max_tokens
    H, bs, seq_len = cfg.train.inner_steps, cfg.train.batch_size, cfg.model.seq_len
    tokens_per_step = workers * bs * (seq_len + 1)
    max_steps = math.ceil(budget / (tokens_per_step * H)) * H if budget > 0 else None
    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    train_rows, eval_rows = build_rows(
        cfg, vocab, None if max_steps is None else max_steps * workers * bs, eval_batches * bs
    )
    if len(train_rows) < workers * bs:
        raise ValueError(f"only {len(train_rows)} train rows; one step needs {workers * bs}")
    data_seconds = time.perf_counter() - started

    server = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=workers)
    # address() names the machine's hostname, which need not resolve to loopback
    lighthouse = f"http://{LOOPBACK}:{server.address().rsplit(':', 1)[1]}"
    try:
        with tempfile.TemporaryDirectory(prefix="torchft_baseline_") as tmp:
            # Rows go by file, not in the spawn args: the parent writes those into each child's pipe
            # while holding its read end, so a child that dies before reading them all would block
            # that write (and this run) forever.
            np.save(Path(tmp, "train.npy"), train_rows)
            np.save(Path(tmp, "eval.npy"), eval_rows)
            args = (workers, lighthouse, cfg, max_steps, max_seconds, eval_batches,
                    tmp, log_every, slow_factor, grace_seconds)  # fmt: skip
            run_processes(_replica_main, args, workers, max_seconds + grace_seconds, "torchft baseline")
            parts = [json.loads(Path(tmp, f"replica{r}.json").read_text()) for r in range(workers)]
    finally:
        server.shutdown()

    steps = parts[0]["steps"]
    if any(p["steps"] != steps for p in parts):
        raise RuntimeError(f"replicas stopped at different steps: {[p['steps'] for p in parts]}")
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    tokens = steps * tokens_per_step
    wire_bytes = sum(p["sent_bytes"] for p in parts) * 2 * (workers - 1) // workers
    result: dict[str, Any] = {
        "mode": "torchft-diloco",
        "workers": workers,
        "eval_loss": parts[0]["eval_loss"],
        "eval_unigram_entropy": unigram_entropy([eval_rows], vocab),
        "eval_rows": min(len(eval_rows), eval_batches * bs),
        "train_loss": parts[0]["train_loss"],
        "tokens_trained": tokens,
        "wall_seconds": wall,
        "trained_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        # per CPU-second of the replicas' processes (every thread) over the loop
        "tokens_per_cpu_s": tokens / cpu if (cpu := sum(p["cpu_seconds"] for p in parts)) > 0 else None,
        "wire_bytes": wire_bytes,
        "wire_bytes_per_token": wire_bytes / tokens if tokens else 0.0,
        "steps": steps,
        "steps_per_second": steps / wall if wall > 0 else 0.0,
        "inner_steps": H,
        "rounds": steps // H,
        "rounds_committed": min(p["rounds_committed"] for p in parts),
        # time in the H-th step's optimizer call: quorum wait (for the slowest replica), all-reduce
        # and outer step
        "sync_wait_share": float(np.mean([p["sync_seconds"] for p in parts])) / wall if wall > 0 else 0.0,
        "sync_seconds_by_replica": [p["sync_seconds"] for p in parts],
        "params": parts[0]["params"],
        "epochs": steps / (len(train_rows) // (workers * bs)),
        "batch_size": bs,
        "seq_len": seq_len,
        "data_seconds": data_seconds,
        "total_seconds": time.perf_counter() - started,
        "config": cfg.to_dict(),
    }
    if out is not None:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="run.toml (RunConfig); flags below override it")
    p.add_argument("--workers", type=int, default=2, help="replica groups (one process each)")
    p.add_argument("--tokens", type=int, help="token budget over all replicas (default: train.max_tokens; 0: none)")  # fmt: skip
    p.add_argument("--minutes", type=float, default=5.0, help="training time limit")
    p.add_argument("--dataset", help='"stdlib", a directory, glob or file')
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--slow-factor", type=float, default=1.0, help="make the last replica FACTOR× slower")
    p.add_argument("--inner-steps", dest="train.inner_steps", type=int, help="overrides train.inner_steps (H)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. model.kwargs.n_layer=2 (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    if args.config:
        cfg = RunConfig.from_toml(args.config)
    else:
        cfg = RunConfig().with_overrides({"data.chunk_bytes": BENCH_CHUNK_BYTES})
    overrides = {"data.dataset": args.dataset, "train.inner_steps": vars(args)["train.inner_steps"]}  # fmt: skip
    cfg = cfg.with_overrides(overrides).with_overrides(parse_assignments(args.overrides))
    result = run_torchft(cfg, workers=args.workers, max_tokens=args.tokens, max_seconds=args.minutes * 60,
                         eval_batches=args.eval_batches, log_every=args.log_every, out=args.out,
                         slow_factor=args.slow_factor)  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main()
