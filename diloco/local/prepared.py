"""`diloco run --prepare-first`: every chunk made into a shard before the first learner starts.

By default a local job overlaps the two: data workers keep a few shards ahead of the learners
while they train. On one machine they then share its cores, and the learners' tokens/s pays for
the tokenizing. With --prepare-first the learners start once the data is ready, as a peer whose
rows are built before its replicas start (benchmarks/torchft_baseline.py) is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def shards_prepared(status: dict[str, Any]) -> tuple[bool, str]:
    """Whether every chunk of the dataset is a shard now (or quarantined, never to be one), and
    how far the data workers are: a pure reading of the coordinator's status."""
    total = int(status.get("chunks_total", 0))
    done = int(status.get("chunks_done", 0)) + int(status.get("chunks_quarantined", 0))
    return bool(total) and done >= total, f"{done}/{total} chunks made into shards"


def wait_until_prepared(
    status: Callable[[], dict[str, Any] | None],
    data_alive: Callable[[], bool],
    deadline: float,
    say: Callable[[str], None],
    poll_s: float = 0.5,
) -> str:
    """Until shards_prepared; returns how far the data got. Stops early (and says why) when no
    data worker is left or the run's time budget is spent: the learners then start on what
    there is, as they would without --prepare-first."""
    reading, started, said = "no status yet", time.monotonic(), 0.0
    while True:
        current = status()
        if current is not None:
            ready, reading = shards_prepared(current)
            if ready:
                return reading
        now = time.monotonic()
        alive = data_alive()  # (asked once: it may also check the coordinator)
        if not alive or now >= deadline:
            why = "no data worker is left" if not alive else "the time budget ran out"
            say(f"[yellow]warning:[/] --prepare-first: {why} at {reading}; the learners start now")
            return reading
        if now - said >= 10:
            said = now
            say(f"preparing the data before the learners start: {reading} ({now - started:.0f} s)")
        time.sleep(poll_s)
