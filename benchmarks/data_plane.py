"""The data plane: data-worker tokens/s per core, shard reads vs raw zstd, learner data stall.

    python benchmarks/data_plane.py --out benchmarks/results/data_plane.json

(a) chunk -> shard, what a data worker does to each chunk (diloco.data.process.process_chunk:
    read, tokenize, pack, shuffle; then diloco.data.shard.encode_shard: zstd + sha256), on real
    chunks of the embedded stdlib corpus cut as `diloco run` cuts them: the same chunks in 1
    process, then split over 2 processes side by side. Printed: tokens/s of each, and the scaling
    ratio (2 processes' tokens/s over 1 process's; 2.0 is perfect on 2 free cores). The store
    write is left out: it is the store's speed, not a core's.
(b) shard read (diloco.data.shard.read_shard: file read, header, zstd decode, sha256 check) next
    to raw zstd decompression of the same compressed bytes, in decompressed GB/s, for a shard of
    the `diloco run` chunk size and one of a 4 MiB chunk. Target: read_shard >= 50% of raw.
(c) a default-shaped `diloco run` (2 learners, 2 data workers, the stdlib corpus) for
    --run-minutes, through the CLI: data_stall_share from its summary.json (target 0%), the
    learners' stall one by one, and the data workers' tokens/s.

Everything runs in this process tree on 127.0.0.1 and stops what it starts (the run is bounded
by its own time budget plus a margin, then stopped with SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard as zstd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.corpus import stdlib_files  # noqa: E402
from diloco.data.chunks import ChunkSpec, partition  # noqa: E402
from diloco.data.process import process_chunk  # noqa: E402
from diloco.data.shard import encode_shard, read_shard, write_shard  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.tokenizer import load_tokenizer  # noqa: E402

# -- (a) data-worker tokens/s per core -----------------------------------------------------------


def _chunk_to_shard(chunk: ChunkSpec, tokenizer: Any, seq_len: int) -> int:
    processed = process_chunk(chunk, tokenizer, seq_len, "text")
    encode_shard(processed.rows, tokenizer_id=tokenizer.id, vocab_size=tokenizer.vocab_size,
                 chunk_index=chunk.index)  # fmt: skip
    return int(processed.rows.size)


def _worker(chunks: list[str], seq_len: int, start: Any, out: Any) -> None:
    """In a child process: warm up, wait for the common start, turn every chunk into a shard."""
    tokenizer = load_tokenizer("byte")
    specs = [ChunkSpec.from_json(c) for c in chunks]
    _chunk_to_shard(specs[0], tokenizer, seq_len)  # imports, allocator and caches warm
    start.wait()
    began = time.monotonic()
    tokens = sum(_chunk_to_shard(c, tokenizer, seq_len) for c in specs)
    out.put((tokens, began, time.monotonic()))


def chunk_throughput(
    chunks: list[ChunkSpec], processes: int, seq_len: int, timeout_s: float
) -> dict[str, Any]:
    """Tokens/s of `processes` processes side by side, the chunks dealt round-robin among them."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    shares = [[c.to_json() for c in chunks[i::processes]] for i in range(processes)]
    procs = [ctx.Process(target=_worker, args=(share, seq_len, start, out), daemon=True) for share in shares]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)
        start.set()
        results = [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    tokens = sum(r[0] for r in results)
    wall = max(r[2] for r in results) - min(r[1] for r in results)
    return {
        "processes": processes,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": tokens / wall,
        "tokens_per_s_per_process": [round(r[0] / (r[2] - r[1])) for r in results],
    }


# -- (b) shard read vs raw zstd ------------------------------------------------------------------


def shard_read_vs_zstd(chunk_bytes: int, workdir: Path, repeats: int) -> dict[str, Any]:
    """read_shard and a bare zstd decompression of the same payload, alternated, median of each."""
    cfg = default_run_config()
    tokenizer = load_tokenizer("byte")
    chunk = partition(stdlib_files(), chunk_bytes, 0.0)[0]
    rows = process_chunk(chunk, tokenizer, cfg.model.seq_len, "text").rows
    uri = str(workdir / f"bench-{chunk_bytes}.shard")
    info = write_shard(uri, rows, tokenizer_id=tokenizer.id, vocab_size=tokenizer.vocab_size, chunk_index=0)
    data, header = encode_shard(
        rows, tokenizer_id=tokenizer.id, vocab_size=tokenizer.vocab_size, chunk_index=0
    )
    body = data[-header["compressed_bytes"] :]
    raw_bytes = rows.size * rows.itemsize
    decompressor = zstd.ZstdDecompressor()

    def timed(fn) -> float:
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    shard_s, raw_s = [], []
    for _ in range(repeats):
        shard_s.append(timed(lambda: read_shard(uri, info.checksum)))
        raw_s.append(timed(lambda: decompressor.decompress(body)))
    shard_gbs = raw_bytes / statistics.median(shard_s) / 1e9
    raw_gbs = raw_bytes / statistics.median(raw_s) / 1e9
    return {
        "chunk_bytes": chunk_bytes,
        "shard_bytes": info.nbytes,
        "decompressed_bytes": raw_bytes,
        "read_shard_gb_per_s": round(shard_gbs, 3),
        "raw_zstd_gb_per_s": round(raw_gbs, 3),
        "ratio": round(shard_gbs / raw_gbs, 3),
    }


# -- (c) learner data stall in a default-shaped run ----------------------------------------------


def default_run(minutes: float, workdir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "cli", "run", "--minutes", str(minutes), "--learners", "2", "--data-workers", "2",
        "--workdir", str(workdir / "run"), "--name", "data-plane", "--no-progress",
        "--set", "eval.every_s=0",  # the evaluator only watches; this measures the data plane
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=minutes * 60 + 300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # diloco run stops its children in order on SIGTERM
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise RuntimeError(f"diloco run overran its budget and was stopped:\n{err[-3000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"diloco run failed ({proc.returncode}):\n{err[-3000:]}")
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    keys = ("data_stall_share", "data_stall_by_learner", "data_tokens_per_s", "data_tokens_per_s_by_worker",
            "tokens_prepared", "tokens_trained", "utilization", "wall_seconds", "chunks", "chunks_done")  # fmt: skip
    return {k: summary.get(k) for k in keys}


# -- the whole benchmark -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=0, help="chunks for (a) (0: the whole corpus)")
    p.add_argument("--passes", type=int, default=8, help="times (a) goes over its chunks")
    p.add_argument("--repeats", type=int, default=30, help="reads of each shard in (b)")
    p.add_argument("--run-minutes", type=float, default=1.0, help="length of the run in (c) (0: skip it)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_plane.json")
    args = p.parse_args(argv)

    started = time.perf_counter()
    load_before = os.getloadavg()[0]  # other work on the machine skews (a) most: it is printed
    cfg = default_run_config()
    seq_len, chunk_bytes = cfg.model.seq_len, cfg.data.chunk_bytes
    chunks = partition(stdlib_files(), chunk_bytes, 0.0)
    chunks = chunks[: args.chunks] if args.chunks else chunks
    corpus_mb = sum(c.nbytes for c in chunks) / 1e6
    print(
        f"== (a) chunk -> shard: {len(chunks)} chunks of the stdlib corpus ({corpus_mb:.1f} MB)",
        file=sys.stderr,
    )
    work = chunks * max(1, args.passes)
    one = chunk_throughput(work, 1, seq_len, timeout_s=600)
    two = chunk_throughput(work, 2, seq_len, timeout_s=600)
    scaling = two["tokens_per_s"] / one["tokens_per_s"]

    print("== (b) shard read vs raw zstd", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="diloco_data_plane_") as tmp:
        reads = [shard_read_vs_zstd(size, Path(tmp), args.repeats) for size in (chunk_bytes, 4 << 20)]

    run = None
    if args.run_minutes > 0:
        print(f"== (c) diloco run, default shape, {args.run_minutes:g} min", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="diloco_data_plane_run_") as tmp:
            run = default_run(args.run_minutes, Path(tmp))

    print(
        f"\n(a) chunk -> shard, {len(chunks)} chunks ({corpus_mb:.1f} MB) x {args.passes} passes, {os.cpu_count()} cores"
    )
    print(f"    {'processes':<12}{'tokens/s':>14}{'per process':>26}")
    for r in (one, two):
        per = ", ".join(f"{t:,}" for t in r["tokens_per_s_per_process"])
        print(f"    {r['processes']:<12}{r['tokens_per_s']:>14,.0f}{per:>26}")
    print(f"    scaling 2 vs 1 process: {scaling:.2f}x (load average {load_before:.1f} before the benchmark)")
    print("\n(b) shard read vs raw zstd decompression (decompressed GB/s, median)")
    print(f"    {'chunk':>10}{'shard MB':>10}{'read_shard':>12}{'raw zstd':>10}{'ratio':>8}")
    for r in reads:
        print(f"    {r['chunk_bytes'] >> 10:>8}Ki{r['shard_bytes'] / 1e6:>10.2f}{r['read_shard_gb_per_s']:>12.2f}"
              f"{r['raw_zstd_gb_per_s']:>10.2f}{r['ratio']:>8.0%}")  # fmt: skip
    if run is not None:
        print(f"\n(c) diloco run, 2 learners, 2 data workers, {run['wall_seconds']:.0f} s")
        print(
            f"    data_stall_share {run['data_stall_share']:.2%}  by learner {run['data_stall_by_learner']}"
        )
        print(f"    data_tokens_per_s {run['data_tokens_per_s']:,.0f} (whole run)  "
              f"by worker, while busy {run['data_tokens_per_s_by_worker']}")  # fmt: skip
        print(f"    chunks {run['chunks_done']}/{run['chunks']}, tokens prepared {run['tokens_prepared']:,}, "
              f"trained {run['tokens_trained']:,}, learner utilization {run['utilization']:.1%}")  # fmt: skip

    result = {
        "chunk_to_shard": {
            "chunks": len(chunks),
            "passes": args.passes,
            "corpus_mb": corpus_mb,
            "one_process": one,
            "two_processes": two,
            "scaling": scaling,
        },
        "shard_read": reads,
        "run": run,
        "cores": os.cpu_count(),
        "load_average_before": load_before,
        "seconds": time.perf_counter() - started,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
