"""Slow links for real: DDP, synchronous DiLoCo and Decoupled DiLoCo behind a shaped link, at equal
wall time, and the simulator's sync-time model checked against the measured pushes and pulls.

    python benchmarks/slow_links.py --links 100mbit:50ms,1gbit:20ms --seconds 75   # needs root (tc)

The `auto` arm (issue 17 item 6) is `diloco run --auto` calibrated from the same link's
`decoupled` arm (its measured step time; the defaults otherwise) and told that link's rate and
shaped round trip: it must end at an eval no worse than the defaults' after the same wall time,
that is, reach the defaults' final loss no later than they do. Arms run in the order given, so
`decoupled` must come before `auto`.

Each link is made with `tc qdisc ... netem` on the loopback device (half the round trip each way,
a rate limit), or, on a kernel without sch_netem (this project's development VM), with `tbf`: the
rate alone, the round trip left at loopback's (~0). Every byte between the job's processes crosses it: DDP's all-reduce between its
ranks, and the learners' pushes and pulls to the coordinator. That is the simplification against
one namespace per learner: here all the job's flows share one link's rate (the learners' pushes
are staggered, so one fragment is rarely on the wire beside another). The link is removed after
each link's arms, also on error. Printed per link and arm: trained tokens/s, eval loss after the
same wall time, wire bytes per token; for the diloco arms the mean push and pull of one fragment
as the coordinator timed them, next to diloco.simulate.costs' prediction for that link
(bytes / rate + RTT / 2). Writes benchmarks/results/slow_links.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import DILOCO_ARMS, run_diloco  # noqa: E402
from benchmarks.ddp_baseline import run_ddp  # noqa: E402
from diloco.config import parse_assignments  # noqa: E402
from diloco.local.evaluation import EVAL_MAX_BATCHES  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.simulate.config import LinkConfig  # noqa: E402
from diloco.simulate.costs import parse_bandwidth, parse_duration, transfer_seconds  # noqa: E402


@contextlib.contextmanager
def shaped_loopback(rate: str, rtt_s: float, gbps: float) -> Iterator[float]:
    """Every packet on `lo` delayed by half the round trip (it crosses lo once each way) and
    limited to `rate`; yields the round trip actually shaped (0 where netem is missing). The qdisc
    is removed on the way out, whatever happened."""
    delay = f"{rtt_s * 1e3 / 2:g}ms"
    # netem's own queue must hold what a rate-limited link has in flight, or it drops.
    netem = f"tc qdisc add dev lo root netem delay {delay} rate {rate} limit 100000".split()
    shaped_rtt = rtt_s
    if subprocess.run(netem, capture_output=True, timeout=10).returncode != 0:
        # tbf's bucket must hold a whole loopback packet (64 KiB) and a tick's worth of the rate.
        burst = max(256 << 10, int(gbps * 1e9 / 8 / 50))
        tbf = f"tc qdisc add dev lo root tbf rate {rate} burst {burst} latency 200ms".split()
        subprocess.run(tbf, check=True, capture_output=True, timeout=10)
        shaped_rtt = 0.0
        print(f"netem is not in this kernel: {rate} by tbf, no added round trip", file=sys.stderr, flush=True)
    try:
        yield shaped_rtt
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=10)


# What `--auto` chooses (diloco.simulate.tune), printed beside its result.
TUNED = ("train.inner_steps", "sync.fragments", "sync.overlap_steps", "sync.codec", "data.chunk_bytes")


def predicted(summary: dict[str, Any], bandwidth_gbps: float, rtt_s: float) -> dict[str, float]:
    """The simulator's time for one fragment each way (fp32 unless the run used a codec)."""
    cfg = summary["config"]
    codec = cfg["sync"]["codec"]
    frag_params = summary["params"] / cfg["sync"]["fragments"]
    link = LinkConfig(params=summary["params"], codec=codec, bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s)
    pull_link = LinkConfig(
        params=summary["params"], codec=cfg["sync"].get("pull_codec") or "fp32",
        bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s,
    )  # fmt: skip
    return {"push_s": transfer_seconds(frag_params, link), "pull_s": transfer_seconds(frag_params, pull_link)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="100mbit:50ms,1gbit:20ms", help="RATE:RTT, comma-separated")
    p.add_argument("--seconds", type=float, default=75.0, help="wall time of every arm")
    p.add_argument("--workers", type=int, default=2, help="DDP ranks = diloco learners")
    p.add_argument("--arms", default="ddp,sync-diloco,decoupled,auto")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "slow_links.json")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("tc needs root")
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    cfg = (
        default_run_config()
        .with_overrides({"train.threads": threads})
        .with_overrides(parse_assignments(args.overrides))
        .validate()
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="diloco_links_") as tmp:
        config_path = Path(tmp) / "run.toml"
        config_path.write_text(cfg.to_toml())
        for spec in args.links.split(","):
            rate, rtt = spec.split(":")
            gbps, rtt_s = parse_bandwidth(rate), parse_duration(rtt)
            with shaped_loopback(rate, rtt_s, gbps) as rtt_s:
                for arm in args.arms.split(","):
                    row_extra: dict[str, Any] = {}
                    print(f"== {spec} {arm}", file=sys.stderr, flush=True)
                    if arm == "ddp":
                        r = run_ddp(cfg, workers=args.workers, max_tokens=0, max_seconds=args.seconds,
                                    eval_batches=EVAL_MAX_BATCHES, log_every=0)  # fmt: skip
                        row = {"link": spec, "rtt_shaped_s": rtt_s, "arm": arm, "eval_loss": r["eval_loss"],
                               "tokens_per_s": r["tokens_per_second"], "wire_bytes_per_token": r["wire_bytes_per_token"]}  # fmt: skip
                    else:
                        name = f"{arm}-{rate}-{rtt}"
                        flags = DILOCO_ARMS.get(arm, [])
                        if arm == "auto":  # tuned for this link from the default arm's own run
                            flags = ["--auto", str(Path(tmp) / f"decoupled-{rate}-{rtt}"),
                                     "--link-bandwidth", rate, "--link-rtt", f"{rtt_s * 1e3:g}ms"]  # fmt: skip
                        r = run_diloco(name, flags, config_path, 0, args.workers, Path(tmp), args.seconds / 60)
                        if arm == "auto":
                            row_extra = {"tuned": {k: r["config"][k.split(".")[0]][k.split(".")[1]]
                                                   for k in TUNED}}  # fmt: skip
                        t = r.get("transfers", {})
                        row = {"link": spec, "rtt_shaped_s": rtt_s, "arm": arm, "eval_loss": r["eval_loss"],
                               "tokens_per_s": r["merged_tokens_per_s"],
                               "wire_bytes_per_token": r["wire_bytes_per_token"],
                               "push_s": t.get("push_seconds_mean"), "pull_s": t.get("pull_seconds_mean"),
                               "predicted": predicted(r, gbps, rtt_s), **row_extra}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(
        f"{'link':<16}{'arm':<14}{'eval':>8}{'tok/s':>9}{'B/tok':>10}{'push s':>9}{'model':>8}{'pull s':>9}{'model':>8}"
    )
    for r in rows:
        m = r.get("predicted") or {}
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-" for k in ("push_s",)]
        print(f"{r['link']:<16}{r['arm']:<14}{r['eval_loss']:>8.4f}{r['tokens_per_s']:>9.0f}"
              f"{r['wire_bytes_per_token']:>10.1f}{cells[0]:>9}{m.get('push_s', float('nan')):>8.3f}"
              f"{r.get('pull_s') or float('nan'):>9.3f}{m.get('pull_s', float('nan')):>8.3f}")  # fmt: skip
    verdicts = []
    for spec in args.links.split(","):  # item 6: tuned no worse than the defaults at equal wall time
        by_arm = {r["arm"]: r for r in rows if r["link"] == spec}
        if "auto" in by_arm and "decoupled" in by_arm:
            ratio = by_arm["auto"]["eval_loss"] / by_arm["decoupled"]["eval_loss"]
            verdicts.append({"link": spec, "auto_over_defaults": round(ratio, 4), "no_later": ratio <= 1.0})
            print(f"{spec}: --auto eval / defaults' = {ratio:.4f} ({'met' if ratio <= 1.0 else 'NOT met'}); "
                  f"tuned {by_arm['auto'].get('tuned')}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"seconds": args.seconds, "workers": args.workers, "config": args.overrides, "rows": rows,
                    "auto_vs_defaults": verdicts}, indent=2) + "\n"
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
