"""Shard reads from local disk next to shard reads from S3 (a real SeaweedFS server on loopback).

    python benchmarks/storage.py --corpus-mb 12 --chunk-mb 1 --threads 1,4 --seconds 4
    python benchmarks/storage.py --corpus-mb 128 --chunk-mb 64    # production-sized, multipart shards

Real shards, as a data worker makes them: the embedded stdlib corpus (repeated past its 11.35 MB
when --corpus-mb asks for more) cut into chunks (diloco.data.chunks.partition), tokenized and
packed (diloco.data.process.process_chunk, byte-level tokenizer), and written by diloco's own
shard writer (diloco.data.shard.write_shard) once to a local directory and once to an S3 bucket.
The S3 server is started here (diloco.testing.seaweed.SeaweedS3) and always stopped.

Then, for each reader count, every shard is read back the way a learner fetches an uncached shard
(diloco.data.shard.read_shard: store.read_bytes, checksum, zstd decode), over and over for
--seconds per side. Printed side by side, local vs S3: MB/s of decoded tokens (the token array a
learner trains on), MB/s of stored bytes (what crossed the store), the S3/local ratio, and the
write rate of the same shards (encode + write). Both stores sit on this machine, so the local side
reads from the page cache and S3 pays HTTP, the gateway, and the filer/volume servers on
loopback: the ratio is the software overhead of the S3 path, not a network's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco import store  # noqa: E402
from diloco.corpus import stdlib_files  # noqa: E402
from diloco.data.chunks import partition  # noqa: E402
from diloco.data.process import process_chunk  # noqa: E402
from diloco.data.shard import ShardInfo, read_shard, write_shard  # noqa: E402
from diloco.testing.seaweed import SeaweedS3  # noqa: E402
from diloco.tokenizer import load_tokenizer  # noqa: E402

MB = 1e6


def corpus_files(budget_bytes: int) -> list[str]:
    """Stdlib files (sorted by path) adding up to about budget_bytes; past its end, it starts again."""
    every = stdlib_files()
    files, total = [], 0
    while total < budget_bytes:
        path = every[len(files) % len(every)]
        files.append(path)
        total += os.path.getsize(path)
    return files


def make_rows(files: list[str], chunk_bytes: int, seq_len: int) -> list[Any]:
    tokenizer = load_tokenizer("byte")
    return [process_chunk(c, tokenizer, seq_len, "text").rows for c in partition(files, chunk_bytes, 0.0)]


def write_all(root: str, shards: list[Any]) -> tuple[list[ShardInfo], float]:
    tokenizer = load_tokenizer("byte")
    started = time.perf_counter()
    infos = [
        write_shard(
            store.join(root, f"chunk-{i:06d}.shard"),
            rows,
            tokenizer_id=tokenizer.id,
            vocab_size=tokenizer.vocab_size,
            chunk_index=i,
        )
        for i, rows in enumerate(shards)
    ]
    return infos, time.perf_counter() - started


def read_for(infos: list[ShardInfo], threads: int, seconds: float) -> dict[str, float]:
    """`threads` readers go through the shards (each its own rotation) until `seconds` pass; >= 1 pass."""
    lock = threading.Lock()
    totals = {"shards": 0, "stored": 0, "decoded": 0}
    stop_at = time.perf_counter() + seconds

    def reader(offset: int) -> None:
        n = done = stored = decoded = 0
        while done < len(infos) or time.perf_counter() < stop_at:
            info = infos[(offset + n) % len(infos)]
            shard = read_shard(info.uri, info.checksum)
            n += 1
            done += 1
            stored += info.nbytes
            decoded += shard.rows.nbytes
        with lock:
            totals["shards"] += done
            totals["stored"] += stored
            totals["decoded"] += decoded

    started = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(i * len(infos) // threads,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    return {
        "seconds": round(elapsed, 3),
        "shards_read": totals["shards"],
        "shards_per_s": round(totals["shards"] / elapsed, 1),
        "decoded_MBps": round(totals["decoded"] / MB / elapsed, 1),
        "stored_MBps": round(totals["stored"] / MB / elapsed, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=12.0, help="raw stdlib text to tokenize (MB)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="raw bytes per chunk = per shard (MiB)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (+1 stored)")
    p.add_argument("--threads", default="1,4", help="comma-separated reader thread counts")
    p.add_argument("--seconds", type=float, default=4.0, help="read time per side and thread count")
    p.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    if not thread_counts or min(thread_counts) < 1 or args.seconds <= 0 or args.chunk_mb <= 0:
        p.error("--threads must list counts >= 1; --seconds and --chunk-mb must be > 0")

    started = time.perf_counter()
    files = corpus_files(int(args.corpus_mb * MB))
    shards = make_rows(files, int(args.chunk_mb * 2**20), args.seq_len)
    print(
        f"{len(files)} stdlib files -> {len(shards)} shards of ~{args.chunk_mb:g} MiB raw text "
        f"({sum(r.size for r in shards) / 1e6:.1f} M tokens, byte-level, seq_len {args.seq_len}) "
        f"in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "shards": len(shards)}
    with (
        tempfile.TemporaryDirectory(prefix="diloco-storage-bench-") as tmp,
        SeaweedS3(Path(tmp) / "s3") as s3,
    ):
        os.environ.update(s3.env)  # diloco.store takes its endpoint and keys from the environment
        roots = {"local": str(Path(tmp) / "local" / "shards"), "s3": s3.create_bucket("bench") + "/shards"}
        # The bucket's first write makes SeaweedFS grow its volumes: not a cost of writing shards.
        store.write_bytes_atomic(store.join(roots["s3"], "warm-up"), b"x")
        store.remove(store.join(roots["s3"], "warm-up"))
        infos: dict[str, list[ShardInfo]] = {}
        for side, root in roots.items():
            infos[side], seconds = write_all(root, shards)
            stored = sum(i.nbytes for i in infos[side])
            result[f"write_{side}"] = {
                "seconds": round(seconds, 3),
                "stored_MBps": round(stored / MB / seconds, 1),
            }
        stored_mb = sum(i.nbytes for i in infos["local"]) / MB
        decoded_mb = sum(r.size for r in shards) * 2 / MB  # uint16 tokens (byte-level vocab)
        print(
            f"stored {stored_mb:.1f} MB ({decoded_mb:.1f} MB of uint16 tokens; "
            f"largest shard {max(i.nbytes for i in infos['local']) / MB:.2f} MB; "
            f"S3 multipart above {store.S3_BLOCK_SIZE / 2**20:.0f} MiB)"
        )
        print(
            f"write (encode + store): local {result['write_local']['stored_MBps']:.1f} MB/s, "
            f"S3 {result['write_s3']['stored_MBps']:.1f} MB/s"
        )
        print(
            f"\n{'readers':>7} | {'local decoded':>13} {'stored':>8} | {'S3 decoded':>10} {'stored':>8} | S3/local"
        )
        for threads in thread_counts:
            row = {side: read_for(infos[side], threads, args.seconds) for side in roots}
            ratio = row["s3"]["decoded_MBps"] / row["local"]["decoded_MBps"]
            result[f"read_threads_{threads}"] = {**row, "ratio_s3_over_local": round(ratio, 3)}
            print(
                f"{threads:>7} | {row['local']['decoded_MBps']:>8.1f} MB/s {row['local']['stored_MBps']:>8.1f} | "
                f"{row['s3']['decoded_MBps']:>5.1f} MB/s {row['s3']['stored_MBps']:>8.1f} | {ratio:.2f}",
                flush=True,
            )
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    print(f"\ntotal {result['total_seconds']}s; the S3 server is stopped")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
