"""One arm of benchmarks/ingest.py alone, to profile the coordinator's process while it ingests.

    python benchmarks/ingest_profile.py --arm tls --seconds 8 --perf /tmp/tls.data
    python benchmarks/ingest_profile.py --arm plain --seconds 8 --perf /tmp/plain.data
    python benchmarks/ingest_profile.py --compare /tmp/plain.data /tmp/tls.data

The same coordinator, pushes and learners as ingest.py's plaintext or mutual-TLS ingest arm, but
only that arm in this process: `perf record -p` (or py-spy) then sees one coordinator's work.
A short warm-up turn first (connections, first merges); then one measured turn of `--seconds`,
its merges drained. With --perf, `perf record -g` runs on this process for exactly that turn.
Printed (and kept beside the perf file as <file>.json): MB/s, server CPU per MB, pushes and
merges (rounds) per GB. --compare reads two such profiles and prints, per MB pushed (not per
second), the samples of each group of symbols and their difference: where the second arm's extra
CPU goes (at 999 Hz a sample is ~1 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._local import (  # noqa: E402
    coordinator_with_shards,
    corpus_repeats,
    leased_rows,
    mtls_coordinator,
    with_learners,
)
from benchmarks._pushers import Pusher, ingest_turn  # noqa: E402
from benchmarks.ingest import PUSH_METHOD, coordinator_overrides  # noqa: E402
from diloco.security.certs import init_ca  # noqa: E402

WARM_UP_S = 2.0
ROWS = 4000  # each push names a row of data of its own: more than a profiled arm's pushes


def merges(running) -> int:
    return sum(f.version for f in running.service.fragments)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=("plain", "tls"), default="tls")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--perf", type=Path, help="record `perf record -g` of this process into this file")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as ingest.py's --set")  # fmt: skip
    p.add_argument("--compare", type=Path, nargs=2, metavar=("BASE", "OTHER"), help="two --perf files")
    args = p.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return
    overrides = coordinator_overrides(assignments=args.assignments)
    with tempfile.TemporaryDirectory(prefix="diloco_ingest_profile_") as tmp:
        tls = None
        if args.arm == "tls":
            ca = Path(tmp) / "ca"
            init_ca(ca)
            running, clients, params, tls = mtls_coordinator(
                ca, Path(tmp) / "c", overrides, args.learners, corpus_repeats(ROWS)
            )
        else:
            running = coordinator_with_shards(Path(tmp) / "c", overrides, repeats=corpus_repeats(ROWS))
            clients, params = with_learners(running, args.learners)
        shapes = {n: tuple(t.shape) for n, t in params.items()}
        ids = [c.worker_id for c in clients]
        pusher = Pusher(f"127.0.0.1:{running.port}", PUSH_METHOD, ids, shapes, running.service.config,
                        args.learners, tls, leased_rows(clients))  # fmt: skip
        perf = None
        try:
            ingest_turn(running, pusher, WARM_UP_S)
            if args.perf:
                perf = subprocess.Popen(
                    ["perf", "record", "-q", "-g", "-F", "999", "-o", str(args.perf), "-p", str(os.getpid())]
                )
            before = merges(running)
            sent, seconds, cpu_s, _ = ingest_turn(running, pusher, args.seconds)
            rounds = merges(running) - before
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(60)
            pusher.close()
            for c in clients:
                c.close()
            running.stop()
    mb = sent / 1e6
    push_mb = sum(t.numel() * 4 for t in params.values()) / 1e6
    result = {
        "arm": args.arm,
        "mb": mb,
        "mb_per_s": mb / seconds,
        "server_cpu_ms_per_mb": cpu_s * 1e3 / mb,
        "pushes": round(mb / push_mb),
        "merges": rounds,
        "merges_per_gb": rounds / mb * 1e3,
    }
    line = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})
    print(line)
    if args.perf:
        Path(f"{args.perf}.json").write_text(line + "\n")


# Symbol groups, first match wins: (group, dso part, symbol parts). Addresses stand for cygrpc's
# stripped symbols: 0x9e0... is BoringSSL's AES-GCM (it appears in TLS profiles only).
GROUPS = [
    ("copies (memmove)", "", ("memmove", "memcpy")),
    ("malloc/free (libc)", "libc", ("malloc", "_int_free", "unlink_chunk", "cfree", "free@plt")),
    ("thread switches, wakeups", "kernel", ("finish_task_switch", "spin_unlock", "futex", "__schedule")),
    ("AES-GCM (in cygrpc)", "cygrpc", ("0x00000000009e0",)),
    ("gRPC core, other", "cygrpc", ("",)),
    ("torch (fold, outer step, norms)", "torch", ("",)),
    ("torch (fold, outer step, norms)", "openblas", ("",)),
    ("kernel, other (sockets, files)", "kernel", ("",)),
    ("Python interpreter", "python", ("",)),
]


def grouped_samples(perf_file: Path) -> dict[str, int]:
    report = subprocess.run(
        ["perf", "report", "-i", str(perf_file), "--no-children", "--sort", "dso,sym", "--stdio", "-g", "none",
         "-n", "-F", "sample,dso,sym", "--field-separator", "\t"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    groups: dict[str, int] = {}
    for line in report.splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 3 or not fields[0].strip().isdigit():
            continue
        samples, dso, sym = int(fields[0]), fields[1], fields[2]
        group = next(
            (g for g, d, parts in GROUPS if d in dso and any(part in sym for part in parts)), "other"
        )
        groups[group] = groups.get(group, 0) + samples
    return groups


def compare(base: Path, other: Path) -> None:
    (a, ga), (b, gb) = [
        (json.loads(Path(f"{f}.json").read_text()), grouped_samples(f)) for f in (base, other)
    ]
    print(f"{'samples per MB pushed':34s} {a['arm']:>8s} {b['arm']:>8s}   difference")
    names = sorted(set(ga) | set(gb), key=lambda g: ga.get(g, 0) / a["mb"] - gb.get(g, 0) / b["mb"])
    for g in [*names, "total"]:
        x = sum(ga.values()) / a["mb"] if g == "total" else ga.get(g, 0) / a["mb"]
        y = sum(gb.values()) / b["mb"] if g == "total" else gb.get(g, 0) / b["mb"]
        print(f"{g:34s} {x:8.3f} {y:8.3f}   {y - x:+.3f}")


if __name__ == "__main__":
    main()
