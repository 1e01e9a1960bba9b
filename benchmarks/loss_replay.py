"""How near honest learners came to the pusher watch's loss bar, replayed from a run's ledger, two
ways: each learner's median over its own last pushes (pusher_watch, the rule as built), and over
one stretch of time for all (since the latest of their oldest kept losses, at least each one's
last MIN_LOSSES: an alternative, measured and not taken).

    diloco run --workdir runs/a --config examples/digits/run.toml --learners 3
    python benchmarks/loss_replay.py runs/a [runs/b ...]

The alternative was meant to narrow honest excesses where a learner pushes less often or began
later while losses fall (its own last pushes are then older than the others'). Measured on 12
honest runs (the digits CNN with and without BatchNorm, a 3x slower GPT learner, GPT learners
killed under chaos; 3 seeds each; results/pusher_watch_one_stretch.json) it came out higher in 10
of 12 (0.08-0.58 against 0.07-0.50): a shorter stretch holds fewer losses, and the median of fewer
losses strays further.

Every push with a reported loss, in the order the coordinator received them, joins its learner's
history; after each, every live learner (pushed within the lease time) is judged; each learner's
highest excess (its median less the other learners' median, over the run's first round's loss) is
printed per way. The run's first loss is the scale throughout (the coordinator has none before
the first merge, so it judges nothing then). Used by benchmarks/pusher_watch.py on its honest runs.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.config import RunConfig  # noqa: E402
from diloco.coordinator.pusher_watch import MIN_LOSSES, WATCH_PUSHES, PusherWatch  # noqa: E402

History = dict[str, list[tuple[float, float]]]  # per learner: (when, loss) of its pushes, oldest first


def own_last_medians(watches: dict[str, PusherWatch], history: History) -> dict[str, float]:
    """The rule as built: each learner's median over its own last pushes, whenever they came."""
    return {w: m for w, watch in watches.items() if (m := watch.loss_median()) is not None}


def one_stretch_medians(watches: dict[str, PusherWatch], history: History) -> dict[str, float]:
    """The alternative: over the stretch since the latest of the learners' oldest kept losses."""
    kept = {w: history[w][-WATCH_PUSHES:] for w in watches if len(history[w]) >= MIN_LOSSES}
    if not kept:
        return {}
    since = max(losses[0][0] for losses in kept.values())
    out = {}
    for w, losses in kept.items():
        inside = [x for at, x in losses if at >= since]
        out[w] = statistics.median(
            inside if len(inside) >= MIN_LOSSES else [x for _, x in losses[-MIN_LOSSES:]]
        )
    return out


WAYS = {"own_last": own_last_medians, "one_stretch": one_stretch_medians}


def highest_excesses(ledger: Path, live_within_s: float) -> dict[str, dict[str, float]]:
    """Per way, each learner's highest loss excess over the run (absent: never judged)."""
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT worker_id, received, loss FROM pushes WHERE loss IS NOT NULL ORDER BY received"
        ).fetchall()
        first = db.execute(
            "SELECT mean_loss FROM rounds WHERE mean_loss > 0 ORDER BY closed LIMIT 1"
        ).fetchone()
    highest: dict[str, dict[str, float]] = {way: {} for way in WAYS}
    if not first:
        return highest
    scale = float(first[0])
    watches: dict[str, PusherWatch] = {}
    history: History = {}
    for worker, at, loss in rows:
        watches.setdefault(worker, PusherWatch()).add(at, None, None, 0, loss)
        history.setdefault(worker, []).append((at, loss))
        live = {w: watch for w, watch in watches.items() if at - watch.last_at <= live_within_s}
        for way, medians in WAYS.items():
            got = medians(live, history)
            for w, m in got.items():
                others = [o for v, o in got.items() if v != w]
                if others:
                    excess = (m - statistics.median(others)) / scale
                    highest[way][w] = max(highest[way].get(w, excess), excess)
    return highest


def replay(workdir: Path) -> dict[str, float]:
    """Per way, the highest excess of any learner in the run at `workdir`."""
    ttl = RunConfig.from_toml(workdir / "run.toml").coordinator.lease_ttl_s
    got = highest_excesses(workdir / "state" / "ledger.sqlite", ttl)
    return {way: round(max(per.values(), default=0.0), 3) for way, per in got.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdirs", nargs="+", type=Path, help="run workdirs (their state/ledger.sqlite)")
    args = p.parse_args(argv)
    for workdir in args.workdirs:
        print(workdir, json.dumps(replay(workdir)))


if __name__ == "__main__":
    main()
