"""Coordinator ingest + merge throughput next to raw gRPC client-streaming of the same bytes.

    python benchmarks/ingest.py --learners 4 --seconds 20 --out benchmarks/results/ingest.json

Both sides run on 127.0.0.1, one after the other: a separate process per arm (the learners are
other processes, as in a real job; in this one they would share the server's interpreter lock),
started once and kept across the turns, runs M threads that stream the very same serialized push
messages (a GPT fragment's delta, fp32, in 1 MiB pieces) to (a) a bare gRPC client-streaming
handler that only reads them, and (b) the real coordinator, which validates, assembles, records
the push in its ledger, merges (quorum 1) and checkpoints. The two take turns (--rounds), so a
change in the machine's load falls on both. Printed: MB/s of push bytes each way, the ratio
(target: ingest + merge >= 50% of raw streaming) over all turns and turn by turn, the server's
CPU time per MB pushed and, per arm, the pushing process's CPU per MB and the cores both sides
kept busy (on a small machine the pushers' CPU is taken from the server's cores).

    python benchmarks/ingest.py --tls --out benchmarks/results/ingest_tls.json

adds a third arm in every turn: a second coordinator that runs mutual TLS (the production path),
each pushing thread on its own learner certificate's channel. Printed beside the others: TLS
ingest over plaintext ingest (target: within 15%), over all turns and turn by turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

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
from diloco.config import RunConfig, parse_assignments  # noqa: E402
from diloco.coordinator.server import grpc_options  # noqa: E402
from diloco.security.certs import init_ca, issue  # noqa: E402
from diloco.security.transport import Security, add_port  # noqa: E402

RAW_METHOD = "/bench.Raw/Ingest"
PUSH_METHOD = "/diloco.v1.Coordinator/PushDelta"


def raw_server(cfg: RunConfig, security: Security | None = None) -> tuple[grpc.Server, int]:
    """A client-streaming handler that reads every message and answers: gRPC's own ceiling
    (with `security`, over its mutual TLS: the transport's own cost of TLS)."""

    def ingest(request_iterator, context):
        n = sum(len(m) for m in request_iterator)
        return n.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Ingest": grpc.stream_unary_rpc_method_handler(ingest)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=grpc_options(cfg))
    server.add_generic_rpc_handlers((handler,))
    port = add_port(server, "127.0.0.1:0", security or Security())
    server.start()
    return server, port


def pin_cpus(pushers) -> None:  # noqa: ANN001
    """This process's threads (the servers') on CPU 0 from now on, the pushers' processes on the
    rest: threads made later inherit their maker's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs")
    for pid, where in [(os.getpid(), {cpus[0]}), *((p.child.pid, set(cpus[1:])) for p in pushers)]:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), where)


def coordinator_overrides(
    n_layer: int = 6, n_embd: int = 384, assignments: Sequence[str] = ()
) -> dict[str, Any]:
    """One fragment merged at every push (quorum 1, no grace window), nothing stale or expired:
    the coordinator ingests and merges as fast as pushes come; then --set's `assignments`."""
    return {
        "model.kwargs.n_layer": n_layer, "model.kwargs.n_embd": n_embd, "model.kwargs.n_head": 6,
        "sync.fragments": 1, "sync.quorum": 1, "sync.grace_factor": 0.0,
        "sync.max_staleness": 1_000_000, "coordinator.lease_ttl_s": 600,
        # Shards enough for every learner to lease some: a push names rows of its own learner's.
        "data.chunk_bytes": 65536, **parse_assignments(list(assignments)),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0, help="per arm, over all rounds")
    p.add_argument("--rounds", type=int, default=4, help="raw and ingest take turns this many times")
    p.add_argument("--n-layer", type=int, default=6)  # coordinator_overrides' model
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--tls", action="store_true", help="a third arm: ingest by a coordinator on mutual TLS")
    p.add_argument("--rows", type=int, default=8000,
                   help="rows of data per coordinator: each push names one it has not named before")  # fmt: skip
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm, e.g. coordinator.stream_chunk_bytes=4194304")  # fmt: skip
    p.add_argument(
        "--pin", action="store_true",
        help="the coordinators on CPU 0, every pusher on the others: the pushers' own TLS, which a "
        "real learner spends on its own machine, off the coordinator's core",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ingest.json")
    args = p.parse_args(argv)
    turn_s = args.seconds / args.rounds
    overrides = coordinator_overrides(args.n_layer, args.n_embd, args.assignments)

    with tempfile.TemporaryDirectory(prefix="diloco_ingest_") as tmp:
        repeats = corpus_repeats(args.rows)
        running = coordinator_with_shards(Path(tmp) / "plain", overrides, repeats=repeats)
        cfg = running.service.config
        clients, params = with_learners(running, args.learners)
        rows = leased_rows(clients)
        shapes = {n: tuple(t.shape) for n, t in params.items()}
        secure, secure_clients, tls_files, raw_tls = None, [], {}, None
        if args.tls:
            ca = Path(tmp) / "ca"
            init_ca(ca)
            secure, secure_clients, _, tls_files = mtls_coordinator(
                ca, Path(tmp) / "tls", overrides, args.learners, repeats
            )
            rows.update(leased_rows(secure_clients))  # (worker ids of their own: the certificates' names)
            # gRPC's own ceiling over the same mutual TLS: what the transport's TLS costs alone.
            raw_tls = raw_server(cfg, Security(tls=issue(ca, "coordinator", "raw")))
        raw, raw_port = raw_server(cfg)
        plain = f"127.0.0.1:{running.port}"
        pushers = {
            "raw": Pusher(f"127.0.0.1:{raw_port}", RAW_METHOD, [], shapes, cfg, args.learners),
            "ingest": Pusher(
                plain, PUSH_METHOD, [c.worker_id for c in clients], shapes, cfg, args.learners, rows=rows
            ),
        }
        if raw_tls is not None:
            pushers["raw_tls"] = Pusher(f"127.0.0.1:{raw_tls[1]}", RAW_METHOD, [], shapes, cfg, args.learners,
                                        {"raw": tls_files["learner-0"]})  # fmt: skip
        if secure is not None:
            pushers["tls"] = Pusher(f"127.0.0.1:{secure.port}", PUSH_METHOD, [c.worker_id for c in secure_clients],
                                    shapes, cfg, args.learners, tls_files, rows)  # fmt: skip
        if args.pin:
            pin_cpus(pushers.values())
        # The arms take turns, so a change in the machine's load falls on all alike. The same
        # pieces go to each; only the header is new per push (its own push_id).
        turns: list[dict[str, float]] = []
        try:
            for _ in range(args.rounds):
                turn: dict[str, float] = {}
                for arm, pusher in pushers.items():
                    coordinator = {"ingest": running, "tls": secure}.get(arm)  # none for the raw arms
                    measured = ingest_turn(coordinator, pusher, turn_s)
                    keys = (f"{arm}_bytes", f"{arm}_s", f"{arm}_cpu_s", f"{arm}_pusher_cpu_s")
                    turn.update(zip(keys, measured, strict=True))
                turns.append(turn)
        finally:
            for pusher in pushers.values():
                pusher.close()
        raw.stop(0)
        if raw_tls is not None:
            raw_tls[0].stop(0)
        versions = [f.version for f in running.service.fragments]
        for c in [*clients, *secure_clients]:
            c.close()
        for r in (running, secure):
            if r is not None:
                r.stop()

    def total(key: str) -> float:
        return sum(t[key] for t in turns)

    def rate(t: dict[str, float], arm: str) -> float:
        return t[f"{arm}_bytes"] / t[f"{arm}_s"]

    ratios = [rate(t, "ingest") / rate(t, "raw") for t in turns]  # in turn order
    result = {
        "learners": args.learners,
        "rounds": args.rounds,
        "params": sum(t.numel() for t in params.values()),
        "push_mb": pushers["raw"].push_bytes / 1e6,
        "raw_mb_per_s": total("raw_bytes") / total("raw_s") / 1e6,
        "ingest_mb_per_s": total("ingest_bytes") / total("ingest_s") / 1e6,
        "merges": sum(versions),
        "round_ratios": ratios,
        # Server CPU per MB pushed: what each byte costs the coordinator, load on the machine aside.
        "raw_cpu_ms_per_mb": total("raw_cpu_s") * 1e3 / (total("raw_bytes") / 1e6),
        "ingest_cpu_ms_per_mb": total("ingest_cpu_s") * 1e3 / (total("ingest_bytes") / 1e6),
    }
    result.update(
        ratio=result["ingest_mb_per_s"] / result["raw_mb_per_s"], overrides=args.assignments, pinned=args.pin
    )
    print(
        f"push of {result['push_mb']:.1f} MB ({result['params']:,} params), {args.learners} concurrent learners, "
        f"{args.rounds} turns of {turn_s:.1f} s per arm"
    )
    print(f"raw gRPC client-streaming : {result['raw_mb_per_s']:8.1f} MB/s")
    print(f"coordinator ingest + merge: {result['ingest_mb_per_s']:8.1f} MB/s  ({result['merges']} merges)")
    print(
        f"ratio                     : {result['ratio']:.0%}  "
        f"(turn by turn: {', '.join(f'{r:.0%}' for r in ratios)}; worst {min(ratios):.0%})"
    )
    print(
        f"server CPU per MB pushed  : raw {result['raw_cpu_ms_per_mb']:.2f} ms, "
        f"ingest + merge {result['ingest_cpu_ms_per_mb']:.2f} ms"
    )
    if args.tls:
        tls_ratios = [rate(t, "tls") / rate(t, "ingest") for t in turns]
        result.update(
            tls_mb_per_s=total("tls_bytes") / total("tls_s") / 1e6,
            tls_cpu_ms_per_mb=total("tls_cpu_s") * 1e3 / (total("tls_bytes") / 1e6),
            tls_turn_ratios=tls_ratios,
            raw_tls_mb_per_s=total("raw_tls_bytes") / total("raw_tls_s") / 1e6,
            raw_tls_cpu_ms_per_mb=total("raw_tls_cpu_s") * 1e3 / (total("raw_tls_bytes") / 1e6),
        )
        result["tls_ratio"] = result["tls_mb_per_s"] / result["ingest_mb_per_s"]
        print(
            f"ingest + merge, mutual TLS: {result['tls_mb_per_s']:8.1f} MB/s  (server CPU {result['tls_cpu_ms_per_mb']:.2f} ms/MB)"
        )
        print(
            f"raw gRPC streaming, mTLS  : {result['raw_tls_mb_per_s']:8.1f} MB/s  "
            f"({result['raw_tls_mb_per_s'] / result['raw_mb_per_s']:.0%} of plaintext; server CPU "
            f"{result['raw_tls_cpu_ms_per_mb']:.2f} ms/MB against {result['raw_cpu_ms_per_mb']:.2f})"
        )
        print(
            f"TLS / plaintext ingest    : {result['tls_ratio']:.0%}  "
            f"(turn by turn: {', '.join(f'{r:.0%}' for r in tls_ratios)}; worst {min(tls_ratios):.0%})"
        )
    # The pushers share this machine's cores with the server: their CPU per MB, and how many
    # cores both sides kept busy, say whether an arm was bound by the machine or by a wait.
    for arm in pushers:
        pusher_s = total(f"{arm}_pusher_cpu_s")
        result[f"{arm}_pusher_cpu_ms_per_mb"] = pusher_s * 1e3 / (total(f"{arm}_bytes") / 1e6)
        result[f"{arm}_cores_busy"] = (total(f"{arm}_cpu_s") + pusher_s) / total(f"{arm}_s")
    busy = [
        f"{a} {result[f'{a}_pusher_cpu_ms_per_mb']:.2f} ms, {result[f'{a}_cores_busy']:.2f}" for a in pushers
    ]
    print(f"pushers' CPU per MB, cores busy (server + pushers): {'; '.join(busy)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
