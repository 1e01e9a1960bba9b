"""How long the simulator takes for the paper's largest job: 2.4 M chips, 24 simulated hours.

    python benchmarks/simulate_speed.py --chips 2400000 --hours 24 --learners 16

Each mode is one process on one core (simpy is single-threaded; the failures are drawn with
numpy up front, ~6,600 for this job at an MTBI of one chip-year). Printed: seconds per mode,
failures, goodput; the target is under a minute per run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco.simulate import MODES, SimConfig, simulate  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", type=int, default=2_400_000)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--learners", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = SimConfig(chips=args.chips, hours=args.hours, learners=args.learners, seed=args.seed)
    worst = 0.0
    for mode in MODES:
        started = time.perf_counter()
        r = simulate(cfg, mode)
        took = time.perf_counter() - started
        worst = max(worst, took)
        print(f"{mode:<12} {took:7.3f} s   {r.failures:>6} failures   goodput {r.goodput:6.1%}")
    print(f"slowest mode: {worst:.3f} s for {args.chips:,} chips over {args.hours:g} h (target < 60 s)")
    if worst >= 60:
        sys.exit(1)


if __name__ == "__main__":
    main()
