"""Every merged round of a finished `diloco run`, lined up with the kills: which rounds held one
push, and what happened just before them.

    python benchmarks/round_timeline.py WORKDIR [--window 6]

A round of one push at M learners is merged at coverage 1/M against a base that lacks the others'
latest work (diloco.coordinator.syncer.missed_round_by); under chaos these are the rounds to
explain. For each round: when it closed (seconds from the first merge), its fragment and version,
who pushed, each push's base lag (versions behind the round), and every kill (summary.json's
kill_log) in the `--window` seconds before it closed. The tail counts single-push rounds by cause
(a kill in the window before them, or none: the schedules drifted apart on their own), and how far
apart the pushes of the other rounds came.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.coordinator.report import read_only  # noqa: E402


def timeline(workdir: Path, window_s: float) -> list[dict]:
    summary = json.loads((workdir / "summary.json").read_text())
    kills = summary.get("kill_log", [])
    with read_only(workdir) as db:
        rounds = db.execute("SELECT fragment, version, closed, pushes FROM rounds ORDER BY closed").fetchall()
        pushes = db.execute(
            "SELECT fragment, merged_version, worker_id, base_version, received FROM pushes WHERE state = 'merged'"
        ).fetchall()
    by_round: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
    for fragment, version, worker, base, received in pushes:
        by_round.setdefault((fragment, version), []).append((worker, base, received))
    out = []
    for fragment, version, closed, count in rounds:
        members = sorted(by_round.get((fragment, version), []), key=lambda m: m[2])
        out.append({
            "closed": closed,
            "fragment": fragment,
            "version": version,
            "pushes": count,
            "pushers": [m[0] for m in members],
            "lags": [version - 1 - m[1] for m in members],
            "spread_s": round(members[-1][2] - members[0][2], 2) if members else 0.0,
            "kills_before": [k["process"] for k in kills if closed - window_s <= k["at"] <= closed],
        })  # fmt: skip
    return out


def mean_spread_s(rows: list[dict]) -> float | None:
    """Seconds from a round's first push to its last, averaged over the rounds of two or more
    (None: none): how long the first pusher trained on past its push before the merge could come.
    Learners that meet in every round can still push seconds apart (syncer.late_in_round_by; a
    resumed learner behind the others, schedule.resume_lag_steps)."""
    met = [r["spread_s"] for r in rows if r["pushes"] > 1]
    return sum(met) / len(met) if met else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path)
    p.add_argument(
        "--window", type=float, default=6.0, help="seconds before a round's close to look for kills"
    )
    args = p.parse_args(argv)
    rows = timeline(args.workdir, args.window)
    if not rows:
        print("no merged rounds")
        return
    t0 = rows[0]["closed"]
    print(
        f"{'t':>7} {'frag':>4} {'ver':>4} {'pushes':>6}  {'pushers (base lag)':<40} kills in the {args.window:g} s before"
    )
    for r in rows:
        who = ", ".join(f"{w} ({lag})" for w, lag in zip(r["pushers"], r["lags"], strict=True))
        print(f"{r['closed'] - t0:>7.1f} {r['fragment']:>4} {r['version']:>4} {r['pushes']:>6}  {who:<40} "
              f"{', '.join(r['kills_before'])}")  # fmt: skip
    single = [r for r in rows if r["pushes"] == 1]
    after_kill = [r for r in single if r["kills_before"]]
    print(f"single-push rounds: {len(single)} of {len(rows)}; after a kill: {len(after_kill)}; "
          f"with no kill in the window: {len(single) - len(after_kill)}")  # fmt: skip
    if (spread := mean_spread_s(rows)) is not None:
        widest = max(r["spread_s"] for r in rows if r["pushes"] > 1)
        print(f"rounds of 2+ pushes: first to last push {spread:.2f} s on average, at most {widest:.2f} s")


if __name__ == "__main__":
    main()
