"""Coordinator memory against the number of learners: one synchronous round of M pushes at once.

    python benchmarks/coordinator_memory.py --learners 2,8,32 --inflight 4

For each M, in a fresh process: a real coordinator (quorum M, one fragment: the round must hold
every learner's delta before it closes) and a separate process in which M threads push a
fragment-sized fp32 delta each, all at once. Printed: the coordinator process's peak resident
memory, and the same in fragments beyond its memory before the pushes. The coordinator folds each
accepted push into the round's sum, and holds at most `coordinator.max_inflight_pushes` pushes
while they stream, so the peak should follow the in-flight limit, not M (target: memory grows
with model size and in-flight pushes, not with the number of learners).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._local import coordinator_with_shards, initial_parameters, leased_rows, span_of  # noqa: E402
from benchmarks._pushers import push_messages  # noqa: E402
from benchmarks.ingest import PUSH_METHOD  # noqa: E402
from diloco.client import CoordinatorClient  # noqa: E402
from diloco.config import RunConfig  # noqa: E402
from diloco.coordinator.server import grpc_options  # noqa: E402
from diloco.v1 import coordinator_pb2 as pb  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _push_once_each(address, worker_ids, shapes, cfg_json, out, rows) -> None:
    """M threads, one push each, all started together; puts the number of accepted pushes."""
    cfg = RunConfig.from_json(cfg_json)
    messages = push_messages(shapes, cfg.coordinator.stream_chunk_bytes)
    template = pb.TensorStreamMessage.FromString(messages[0])
    channel = grpc.insecure_channel(address, options=grpc_options(cfg))
    call = channel.stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)
    accepted, lock, start = [0], threading.Lock(), threading.Barrier(len(worker_ids))

    def push(worker_id: str) -> None:
        header = pb.TensorStreamMessage()
        header.header.CopyFrom(template.header)
        header.header.push_id, header.header.worker_id = uuid.uuid4().hex, worker_id
        shard, row = span_of(rows[worker_id], worker_id)  # a row its learner leased, as a push names
        header.header.spans.add(shard_id=shard, row_start=row, row_end=row + 1)
        start.wait()
        for _ in range(200):  # RESOURCE_EXHAUSTED (over the in-flight limit): come back, as learners do
            try:
                reply = call(iter([header.SerializeToString(), *messages[1:]]), timeout=120)
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
        with lock:
            accepted[0] += int(reply.accepted)

    threads = [threading.Thread(target=push, args=(w,)) for w in worker_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    out.put(accepted[0])


def one(learners: int, inflight: int, n_layer: int, n_embd: int) -> dict[str, float]:
    """One M, in this process: the coordinator's memory before and after the round."""
    with tempfile.TemporaryDirectory(prefix="diloco_mem_") as tmp:
        running = coordinator_with_shards(Path(tmp), {
            "model.kwargs.n_layer": n_layer, "model.kwargs.n_embd": n_embd, "model.kwargs.n_head": 6,
            "sync.fragments": 1, "sync.quorum": learners, "sync.grace_factor": 0.0,
            "coordinator.max_inflight_pushes": inflight, "coordinator.lease_ttl_s": 600,
            # Every learner here calls from one host: the per-caller cap would stand in for the slots.
            "coordinator.max_pushes_per_caller": 0, "coordinator.max_workers_per_caller": 0,
            # A shard per learner at least: a push names rows of a shard its own learner leased.
            "data.chunk_bytes": 4096,
        }, repeats=max(4000, learners * 200))  # fmt: skip
        cfg = running.service.config
        clients = [CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE) for _ in range(learners)]
        for c in clients:
            c.join()
        params = initial_parameters(clients[0])
        clients[0].init_parameters(params)
        fragment_mb = sum(t.numel() * 4 for t in params.values()) / 2**20
        before = peak_rss_mb()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        shapes = {n: tuple(t.shape) for n, t in params.items()}
        child = ctx.Process(
            target=_push_once_each,
            args=(
                f"127.0.0.1:{running.port}",
                [c.worker_id for c in clients],
                shapes,
                cfg.to_json(),
                out,
                leased_rows(clients),
            ),  # fmt: skip
        )
        child.start()
        accepted = out.get(timeout=600)
        child.join(30)
        assert running.service.wait_published(120), "the round did not merge"
        merges = running.service.fragments[0].version
        for c in clients:
            c.close()
        running.stop()
    peak = peak_rss_mb()
    return {
        "learners": learners,
        "accepted": accepted,
        "merges": merges,
        "fragment_mb": fragment_mb,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
        "growth_in_fragments": (peak - before) / fragment_mb,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", default="2,8,32", help="comma-separated values of M")
    p.add_argument("--inflight", type=int, default=4, help="coordinator.max_inflight_pushes")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one M, print JSON
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "coordinator_memory.json")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.inflight, args.n_layer, args.n_embd)))
        return

    rows = []
    for m in (int(x) for x in args.learners.split(",")):
        # A fresh process per M: peak memory only ever grows within one.
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(m), "--inflight", str(args.inflight),
             "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)],
            capture_output=True, text=True, timeout=900, check=True,
        )  # fmt: skip
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"M = {m:3d}: {r['accepted']}/{m} pushes merged in {r['merges']} round(s); coordinator peak "
            f"{r['peak_rss_mb']:.0f} MB, {r['growth_in_fragments']:.1f} fragments ({r['fragment_mb']:.0f} MB "
            f"each) above its {r['rss_before_mb']:.0f} MB before the round",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"inflight": args.inflight, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
