"""What watching a run costs, and how fast its page loads.

    python benchmarks/observe.py --pairs 4 --tokens 600000 --ingest-rounds 6   # (a), (b) and (c)
    python benchmarks/observe.py --pairs 0 --ingest-rounds 0                   # (b) only

(a) Learners: the same `diloco run` (same seed, same token budget) with the status page, /metrics and
    a scraper that reads /metrics, /api/status and /api/history every 2 s (as Prometheus and an
    open page would, with the run's credentials: `diloco run` serves them over TLS behind its
    token), next to one with all of it off (--http-port -1). The evaluator is off in both (it is a
    role of its own, not the page's cost). One unwatched warm-up run first (the machine's first run
    is slower, whichever arm it is); then pairs, alternating which arm runs first. Printed, as the
    ratio on/off with mean, sd and worst over the pairs: each learner's tokens per second of its own
    training time (first inner step to last: start-up left out), its speed in its inner steps
    (tokens per busy second), and data workers' tokens/s. Target: within 2%.
(b) Page load: a coordinator's HTTP side fed with the history of a long run — 64 learners, 10,000
    merges, the in-memory event ring full — and headless Chromium loads the page; the page
    records the milliseconds from navigation to its first full picture (data-render-ms).
    Target: under 1 s. Also printed: the bytes and server time of /api/history and /api/status.
(c) Ingest: the coordinator's ingest + merge (benchmarks/ingest.py's pushes, from another process)
    with its page and /metrics served and scraped every 2 s by another process, against the same
    coordinator with them off, in alternating turns. Target: within 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.observe.events import KEEP_EVENTS, RunEvents  # noqa: E402
from diloco.observe.http import ObserveServer  # noqa: E402
from diloco.observe.prometheus import CoordinatorMetrics  # noqa: E402
from diloco.security.transport import Security  # noqa: E402

LEARNERS, MERGES = 64, 10_000


def run_once(
    workdir: Path, name: str, watched: bool, tokens: int, minutes: float, seed: int
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "cli", "run", "--workdir", str(workdir / name), "--name", name, "--no-progress",
        "--tokens", str(tokens), "--minutes", str(minutes), "--seed", str(seed), "--set", "eval.every_s=0",
        *(["--http-port", "0", "--metrics-port", "0"] if watched else ["--http-port", "-1"]),
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stop = threading.Event()
    scrapes = [0]

    def scrape() -> None:  # Prometheus and an open page, every 2 s
        info_path = workdir / name / "coordinator.json"
        while not stop.wait(2.0):
            try:
                info = json.loads(info_path.read_text())
                read_all(info, workdir / name / "tls" / "ca.crt")
                scrapes[0] += 1
            except (OSError, KeyError, ValueError):
                continue

    scraper = threading.Thread(target=scrape, daemon=True)
    if watched:
        scraper.start()
    out, _ = proc.communicate(timeout=minutes * 60 + 600)
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out[-3000:]}")
    s = json.loads((workdir / name / "summary.json").read_text())
    busy = [d["tokens_per_s"] for d in s["learners_detail"].values() if d.get("tokens_per_s")]
    return {
        "learner_tokens_per_s": s["learner_tokens_per_s"] / s["learners"],
        "learner_busy_tokens_per_s": statistics.mean(busy) if busy else 0.0,
        "data_tokens_per_s": s.get("data_tokens_per_s", 0.0),
        "eval_loss": s["eval_loss"],
        "scrapes": scrapes[0],
    }


def read_all(info: dict[str, Any], ca: Path) -> None:
    """/metrics, /api/status and /api/history once, as a scraper with the run's token would."""
    token = parse_qs(urlsplit(info["page_url"]).query).get("token", [""])[0]
    context = ssl.create_default_context(cafile=str(ca)) if info["page_url"].startswith("https") else None
    page = info["page_url"].split("?", 1)[0]
    for url in (info["metrics_url"], page + "api/status", page + "api/history"):
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        urllib.request.urlopen(request, timeout=5, context=context).read()


COST_KEYS = ("learner_tokens_per_s", "learner_busy_tokens_per_s", "data_tokens_per_s")


def cost(pairs: int, tokens: int, minutes: float, null: bool = False, first_seed: int = 1) -> dict[str, Any]:
    """Pairs of runs, watched ("on") and not; with `null`, neither is watched: the noise floor
    of the same measure (what two identical runs differ by)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-observe-") as tmp:
        run_once(Path(tmp), "warmup", False, tokens, minutes, seed=99)
        for i in range(pairs):
            order = [True, False] if i % 2 == 0 else [False, True]
            got = {
                w: run_once(
                    Path(tmp),
                    f"p{i}-{'on' if w else 'off'}",
                    w and not null,
                    tokens,
                    minutes,
                    seed=first_seed + i,
                )
                for w in order
            }
            rows.append({"seed": first_seed + i, "on": got[True], "off": got[False]})
            print(f"pair {i + 1}: " + "; ".join(f"{k} on {got[True][k]:,.0f} off {got[False][k]:,.0f}" for k in COST_KEYS)
                  + f"; {got[True]['scrapes']} scrapes", flush=True)  # fmt: skip
            if not null and not got[True]["scrapes"]:
                raise RuntimeError("the watched run was never scraped: the measure would be void")
    result: dict[str, Any] = {"pairs": rows}
    for key in COST_KEYS:
        ratios = [r["on"][key] / r["off"][key] for r in rows if r["off"][key]]
        result[key] = {"mean_ratio": statistics.mean(ratios), "worst_ratio": min(ratios),
                       "stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0}  # fmt: skip
    return result


SCRAPER = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from benchmarks.observe import read_all
info = json.loads(sys.argv[1])
while True:
    started = time.monotonic()
    read_all(info, None)
    print("scraped", flush=True)
    time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
"""


def ingest_cost(rounds: int, seconds: float, learners: int) -> dict[str, Any]:
    """The coordinator's ingest + merge with its HTTP side served and scraped every 2 s by another
    process, against the same coordinator with it off, in alternating turns (plaintext, as in
    benchmarks/ingest.py: the scraper's own TLS would be the scraper's cost)."""
    from benchmarks._local import coordinator_with_shards, corpus_repeats, leased_rows, with_learners
    from benchmarks._pushers import Pusher, ingest_turn
    from benchmarks.ingest import PUSH_METHOD, coordinator_overrides
    from diloco.coordinator.server import ObservePorts, start_observers
    from diloco.security.transport import Security

    overrides = coordinator_overrides()
    turns = []
    with tempfile.TemporaryDirectory(prefix="diloco-observe-ingest-") as tmp:
        running = coordinator_with_shards(Path(tmp), overrides, repeats=corpus_repeats(4000))
        clients, params = with_learners(running, learners)
        shapes = {n: tuple(t.shape) for n, t in params.items()}
        cfg = running.service.config
        pusher = Pusher(
            f"127.0.0.1:{running.port}",
            PUSH_METHOD,
            [c.worker_id for c in clients],
            shapes,
            cfg,
            learners,
            rows=leased_rows(clients),
        )
        try:
            for i in range(rounds):
                got = {}
                for watched in [False, True] if i % 2 == 0 else [True, False]:
                    servers, scraper, scrapes = [], None, 0
                    if watched:
                        servers = start_observers(running.service, ObservePorts(0, 0), Security(), tmp)
                        info = {"page_url": next(o.url for o in servers if o.page),
                                "metrics_url": next(o.url for o in servers if not o.page) + "metrics"}  # fmt: skip
                        scraper = subprocess.Popen(
                            [sys.executable, "-c", SCRAPER, json.dumps(info), str(ROOT)],
                            stdout=subprocess.PIPE, text=True,
                        )  # fmt: skip
                        assert (
                            scraper.stdout is not None and scraper.stdout.readline()
                        )  # scraping before pushes start
                    try:
                        sent, secs, cpu, _ = ingest_turn(running, pusher, seconds)
                    finally:
                        if scraper is not None:
                            scraper.kill()
                            scrapes = 1 + len(scraper.communicate(timeout=10)[0].splitlines())
                        for o in servers:
                            o.stop()
                    got[watched] = {"mb_per_s": sent / secs / 1e6, "cpu_ms_per_mb": cpu * 1e3 / (sent / 1e6),
                                    "scrapes": scrapes}  # fmt: skip
                turns.append(got)
                print(f"ingest turn {i + 1}: on {got[True]['mb_per_s']:.0f} MB/s ({got[True]['scrapes']} scrapes), "
                      f"off {got[False]['mb_per_s']:.0f} MB/s",
                      flush=True)  # fmt: skip
        finally:
            pusher.close()
            for c in clients:
                c.close()
            running.stop()
    ratios = [t[True]["mb_per_s"] / t[False]["mb_per_s"] for t in turns]
    return {"turns": [{"on": t[True], "off": t[False]} for t in turns], "mean_ratio": statistics.mean(ratios),
            "worst_ratio": min(ratios), "stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0}  # fmt: skip


def synthetic_history(events: RunEvents, start: float) -> dict[str, Any]:
    """A long run's events and status: 64 learners reporting every 3 s, 10,000 merges."""
    t = start
    merged = 0
    per_merge = max(1, (KEEP_EVENTS - MERGES) // MERGES)  # learner reports between merges: the ring full
    for m in range(MERGES):
        merged += 4096
        for k in range(per_merge):
            w = (m * per_merge + k) % LEARNERS
            events.record("learner", worker_id=f"learner-{w}", loss=3.0 - m / MERGES, utilization=0.9,
                          inner_steps=m, tokens_trained=merged // LEARNERS, tokens_merged=merged)  # fmt: skip
        events.record("merge", fragment=m % 2, version=m // 2 + 1, pushes=3, tokens=4096, mean_loss=3.0 - m / MERGES,
                      tokens_merged=merged)  # fmt: skip
        if m % 20 == 0:
            events.record("progress", merged_tokens_per_s=12_000.0, wire_bytes_per_token=80.0,
                          learners_alive=LEARNERS, tokens_merged=merged)  # fmt: skip
        if m % 100 == 0:
            events.record("eval", loss=3.0 - m / MERGES, metrics={}, tokens_merged=merged, rows=256)
        t += 1.0
    workers = [
        {"worker_id": f"learner-{i}", "role": "compute", "host": "h", "state": "active", "alive": True,
         "inner_steps": 5000, "tokens_trained": 10**7, "last_loss": 2.1, "busy_seconds": 900.0,
         "wall_seconds": 1000.0, "data_stall_seconds": 5.0, "last_push_age_s": 3.2, "train_metrics": {}}
        for i in range(LEARNERS)
    ]  # fmt: skip
    evals = [{"loss": 2.0, "metrics": {}, "fragment_versions": [5000, 5000], "tokens_merged": merged}] * 200
    return {
        "run_state": "running", "coordinator_epoch": 4, "uptime_s": 86400.0, "tokens_prepared": 10**10,
        "tokens_leased": 10**10, "tokens_trained": 10**10, "tokens_merged": merged, "fragment_versions": [5000, 5000],
        "rounds": MERGES, "pushes_received": 30_000, "pushes_refused": 12, "wire_by_rpc": {},
        "chunks_by_state": {"done": 5000}, "chunks_total": 5000, "chunks_done": 5000, "chunks_quarantined": 0,
        "shards_total": 5000, "shards_consumed": 4000, "eval_split": {"shards": []}, "evals": evals,
        "last_loss": 2.1, "workers": workers,
    }  # fmt: skip


def page_load(repeats: int) -> dict[str, Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    events = RunEvents(None)
    detail = synthetic_history(events, time.time() - MERGES)
    server = ObserveServer("127.0.0.1", 0, metrics=CoordinatorMetrics(lambda: detail), detail=lambda: detail,
                           events=events, page=True, security=Security(), access_token="")  # fmt: skip
    try:
        served = {}
        for path in ("api/history", "api/status"):
            started = time.perf_counter()
            body = urllib.request.urlopen(server.url + path, timeout=30).read()
            served[path] = {"bytes": len(body), "seconds": round(time.perf_counter() - started, 4)}
        renders = []
        for _ in range(repeats if chromium else 0):
            dom = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--virtual-time-budget=3000", "--dump-dom", server.url],
                capture_output=True, text=True, timeout=120, check=True,
            ).stdout  # fmt: skip
            found = re.search(r'data-render-ms="(\d+)"', dom)
            rows = len(re.findall(r'<tr class="learner[^"]*" data-worker="learner-\d+"', dom))
            if found and rows == LEARNERS:
                renders.append(int(found.group(1)))
    finally:
        server.stop()
    return {"events_kept": len(events.recent()), "served": served, "render_ms": renders,
            "render_ms_worst": max(renders) if renders else None}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=600_000)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--page-repeats", type=int, default=3)
    p.add_argument("--ingest-rounds", type=int, default=6, help="(c): turns of each arm; 0: skip")
    p.add_argument("--null", action="store_true", help="(a) with neither run watched: the noise floor")
    p.add_argument("--first-seed", type=int, default=1, help="(a): pair i runs seed first_seed + i")
    p.add_argument("--ingest-seconds", type=float, default=5.0, help="(c): seconds of pushes per turn")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "observe.json")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"page": page_load(a.page_repeats)}
    print(f"page: {result['page']['events_kept']:,} events, /api/history {result['page']['served']['api/history']}, "
          f"/api/status {result['page']['served']['api/status']}; Chromium's first full render "
          f"{result['page']['render_ms']} ms (target < 1000)", flush=True)  # fmt: skip
    if a.ingest_rounds:
        r = result["ingest"] = ingest_cost(a.ingest_rounds, a.ingest_seconds, learners=4)
        print(f"ingest + merge on/off: mean {r['mean_ratio']:.3f}, worst {r['worst_ratio']:.3f}, sd {r['stdev']:.3f} "
              f"(target >= 0.98)", flush=True)  # fmt: skip
    if a.pairs:
        result["cost"] = cost(a.pairs, a.tokens, a.minutes, a.null, a.first_seed)
        result["cost"]["null"] = a.null
        for key in COST_KEYS:
            r = result["cost"][key]
            print(f"{key} on/off: mean {r['mean_ratio']:.3f}, worst {r['worst_ratio']:.3f}, sd {r['stdev']:.3f} "
                  f"(target >= 0.98)")  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
