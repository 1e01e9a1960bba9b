"""What the coordinator's ledger costs as a run grows: a week of pushes, a large dataset.

    python benchmarks/ledger_scale.py --chunks 1000,20000 --pushes 10000,1000000 --events 3000000

A week-long run's ledger holds every push, span and round it ever recorded, and its
metrics.jsonl every event: nothing in them is removed. For each size this builds such a ledger
(real schema, rows inserted in bulk: shards mostly consumed, pushes mostly merged, their spans on
those shards), then times the calls the coordinator makes over and over on the real Ledger:

- tick      reclaim_expired, what the syncer's ticker runs every 0.25 s (lease expiry);
- status    summary, last_pushes, workers, evals, eval_split: what every Status, /api/status
              and /metrics read;
- lease     lease_shard, a learner's next shard;
- push      record_push + commit_merges of one new push and its merge (the merge path);
- restart   pending_pushers + next_epoch, what a restarted coordinator asks first;

and read_events on a metrics.jsonl of --events lines (a restarted coordinator's page history).
Every call holds the ledger's one lock: a pushing learner waits for whatever runs. Printed:
the median of --repeat calls, in ms, per size. A call whose cost follows the run's length or the
dataset's size is what a week-long run would find slow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.coordinator.ledger import Ledger, MergeRecord  # noqa: E402
from diloco.observe.events import KEEP_EVENTS, read_events  # noqa: E402

ROWS = 512  # rows per shard
ROW_TOKENS = 129
SPAN_ROWS = 8  # rows a push names on its shard (one span a push: enough for the shape)
LEARNERS = 8
FRAGMENTS = 2
TTL_S = 30.0


def build(path: Path, chunks: int, pushes: int, ready: int) -> Ledger:
    """A ledger of `chunks` done chunks (one shard each; the first 1% held out, the last `ready`
    not trained yet, the rest consumed) and `pushes` merged pushes, one span each, in rounds of two."""
    ledger = Ledger(str(path))
    db = ledger._db
    now = time.time()
    with ledger._lock:
        db.execute("BEGIN")
        evals = max(1, chunks // 100)  # the first 1% held out, as the eval split

        def split(c: int) -> str:
            return "eval" if c <= evals else "train"

        db.executemany(
            "INSERT INTO chunks(id, spec, split, nbytes, state, attempts, lease_order) VALUES (?, ?, ?, ?, 'done', 1, ?)",
            ((c, json.dumps({"index": c - 1}), split(c), 1 << 20, c) for c in range(1, chunks + 1)),
        )
        db.executemany(
            "INSERT INTO shards(id, chunk_id, completion_id, uri, split, rows, tokens, checksum, nbytes, state, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'x', ?, ?, ?)",
            (
                (c, c, uuid.uuid4().hex, f"/store/shards/{c}.zst", split(c), ROWS, ROWS * ROW_TOKENS, 1 << 19,
                 "ready" if c > chunks - ready or c <= evals else "consumed", now)
                for c in range(1, chunks + 1)
            ),
        )  # fmt: skip
        db.executemany(
            "INSERT INTO workers(id, role, host, joined, last_seen, state, stats) VALUES (?, 'compute', 'h', ?, ?, 'active', '{}')",
            ((f"learner-{i}", now, now) for i in range(LEARNERS)),
        )
        consumed = max(1, chunks - ready - evals)  # train shards evals+1 .. evals+consumed
        per_shard = ROWS // SPAN_ROWS

        def push_rows():
            for i in range(pushes):
                fragment = i % FRAGMENTS
                version = i // (2 * FRAGMENTS) + 1
                yield (f"p{i}", f"learner-{i % LEARNERS}", fragment, version - 1, 50, 50 * 8 * 128,
                       "merged", version, now - (pushes - i))  # fmt: skip

        db.executemany(
            "INSERT INTO pushes(push_id, worker_id, fragment, base_version, steps, tokens, state, merged_version, received) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            push_rows(),
        )
        # spans: push i covers rows of consumed shard (i // per_shard) % consumed + 1
        db.executemany(
            "INSERT INTO spans(shard_id, row_start, row_end, push_id) VALUES (?, ?, ?, ?)",
            (
                ((i // per_shard) % consumed + evals + 1, (i % per_shard) * SPAN_ROWS, (i % per_shard + 1) * SPAN_ROWS, f"p{i}")
                for i in range(pushes)
            ),
        )  # fmt: skip
        db.executemany(
            "INSERT OR IGNORE INTO rounds(fragment, version, closed, pushes, tokens, steps) VALUES (?, ?, ?, 2, 1, 1)",
            ((i % FRAGMENTS, i // (2 * FRAGMENTS) + 1, now - (pushes - i)) for i in range(0, pushes, 2)),
        )
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('dataset', 'synthetic')")
        db.execute("COMMIT")
    return ledger


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median wall time of `repeat` calls, in ms."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(chunks: int, pushes: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ledger_scale_") as tmp:
        started = time.perf_counter()
        ledger = build(Path(tmp) / "ledger.sqlite", chunks, pushes, ready=min(64, chunks // 2))
        built_s = time.perf_counter() - started
        counter = iter(range(10**9))

        def status() -> None:  # the ledger's part of status_detail
            ledger.summary()
            ledger.last_pushes()
            ledger.workers()
            ledger.evals(last=20)
            ledger.eval_split()

        def push() -> None:
            # A new push on a ready shard's next rows, and its merge as a round of its own.
            n = next(counter)
            shard = chunks - (n % 32)
            a = (n // 32) * SPAN_ROWS % ROWS
            pid = f"new{n}"
            ledger.record_push(pid, "learner-0", 0, 0, 50, 1000, [(shard, a, a + SPAN_ROWS)], [])
            version = 10**7 + n
            ledger.commit_merges(0, [MergeRecord(version, (pid,), 1000, 50, None, "quorum")])

        def restart() -> None:
            ledger.pending_pushers()
            ledger.next_epoch()

        out = {
            "chunks": chunks,
            "pushes": pushes,
            "build_s": round(built_s, 1),
            "tick_ms": timed(lambda: ledger.reclaim_expired(TTL_S, 3), repeat),
            "status_ms": timed(status, repeat),
            "lease_ms": timed(lambda: ledger.lease_shard("learner-1", TTL_S), repeat),
            "push_and_merge_ms": timed(push, repeat),
            "restart_ms": timed(restart, max(1, repeat // 4)),
        }
        ledger.close()
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def events_cost(lines: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="events_scale_") as tmp:
        path = Path(tmp) / "metrics.jsonl"
        event = {"kind": "learner", "at": 1.0e9, "worker_id": "learner-3", "loss": 2.345678,
                 "utilization": 0.97, "tokens_merged": 123456789}  # fmt: skip
        line = json.dumps(event) + "\n"
        with open(path, "w") as f:
            for _ in range(lines // 10_000):
                f.write(line * 10_000)
        size = path.stat().st_size
        ms = timed(lambda: read_events(path, last=KEEP_EVENTS), repeat)
        return {"events": lines, "file_mb": round(size / 1e6, 1), "read_tail_ms": round(ms, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="1000,20000", help="comma-separated dataset sizes (chunks)")
    p.add_argument("--pushes", default="10000,1000000", help="comma-separated run lengths (pushes)")
    p.add_argument("--events", default="100000,3000000", help="comma-separated metrics.jsonl lengths")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for chunks in (int(x) for x in args.chunks.split(",")):
        for pushes in (int(x) for x in args.pushes.split(",")):
            rows.append(measure(chunks, pushes, args.repeat))
            print(json.dumps(rows[-1]), flush=True)
    events = [events_cost(int(x), max(1, args.repeat // 10)) for x in args.events.split(",")]
    for row in events:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"ledger": rows, "events": events}, indent=1) + "\n")


if __name__ == "__main__":
    main()
