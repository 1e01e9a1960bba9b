"""When things fail: every failure time of a run, drawn up front from one seeded generator.

Chips are never simulated one by one. N chips that each fail as a Poisson process of rate
1 / MTBI make one Poisson process of rate N / MTBI (superposition), and each of its failures hits
a uniformly random chip, hence a slice (or learner) chosen uniformly among equal-sized ones: so a
run draws the number of failures (Poisson with mean N T / MTBI), their times (uniform on [0, T),
sorted) and their slices (uniform). A 2.4 M-chip day is ~6,600 failures, drawn in microseconds.

A Weibull shape makes each *slice* a renewal process (its chips fail together as one unit; the
superposition of its many chips' processes would be nearly Poisson anyway, by Palm-Khintchine):
S slices of renewal draws, still S processes and not N. Every slice starts fresh at t = 0.

A measured trace replaces the draw: its times as given, each on the unit it names or a random one.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diloco.simulate.config import SECONDS_PER_YEAR, FailureConfig


@dataclass(frozen=True)
class Failures:
    """Failure times (seconds, sorted) and the unit each one hits."""

    times: np.ndarray
    units: np.ndarray

    def __len__(self) -> int:
        return len(self.times)


def chip_failures(
    failure: FailureConfig, *, chips: int, slices: int, units: int, horizon_s: float, rng: np.random.Generator
) -> Failures:
    """The run's chip failures, each mapped to one of `units` equal units (learners, or slices).

    slices: how many slices the chips form (each fails as one); a slice s belongs to unit
    s * units // slices.
    """
    if failure.trace is not None:
        times = np.array(sorted(t for t in failure.trace if 0 <= t < horizon_s), dtype=float)
        if failure.trace_units is not None:
            pairs = sorted(
                (t, u) for t, u in zip(failure.trace, failure.trace_units, strict=True) if 0 <= t < horizon_s
            )
            hit = np.array([u % units for _, u in pairs], dtype=np.int64)
        else:
            hit = rng.integers(0, units, size=len(times))
        return Failures(times, hit)
    mtbi_s = failure.mtbi_years * SECONDS_PER_YEAR
    if failure.weibull_shape is None or failure.weibull_shape == 1.0:
        count = rng.poisson(chips * horizon_s / mtbi_s)
        times = np.sort(rng.uniform(0.0, horizon_s, size=count))
        slice_hit = rng.integers(0, slices, size=count)
    else:
        times, slice_hit = _weibull_renewals(
            failure.weibull_shape, mtbi_s * slices / chips, slices, horizon_s, rng
        )
    return Failures(times, slice_hit * units // slices)


def _weibull_renewals(
    shape: float, mean_s: float, slices: int, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Every failure before horizon_s of `slices` renewal processes with Weibull gaps of mean_s."""
    scale = mean_s / math.gamma(1 + 1 / shape)
    clock = np.zeros(slices)
    times, owners = [], []
    active = np.arange(slices)
    while active.size:
        clock[active] += scale * rng.weibull(shape, size=active.size)
        inside = clock[active] < horizon_s
        times.append(clock[active][inside])
        owners.append(active[inside])
        active = active[inside]
    all_times, all_owners = np.concatenate(times), np.concatenate(owners)
    order = np.argsort(all_times, kind="stable")
    return all_times[order], all_owners[order]


def coordinator_failures(failure: FailureConfig, *, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    """The coordinator's failure times: a trace, a Poisson process, or none."""
    if failure.coordinator_trace is not None:
        return np.array(sorted(t for t in failure.coordinator_trace if 0 <= t < horizon_s), dtype=float)
    if not failure.coordinator_mtbi_s:
        return np.zeros(0)
    count = rng.poisson(horizon_s / failure.coordinator_mtbi_s)
    return np.sort(rng.uniform(0.0, horizon_s, size=count))


@dataclass
class SparePool:
    """Hot spare slices: a failed slice is replaced by a free spare at once, or by the next slice
    that comes back from repair; the failed one goes to repair and then into the pool."""

    free: int | None  # None: unbounded
    repair_s: float
    _returns: list[float] = field(default_factory=list)  # sorted times slices come back

    def take(self, now: float) -> float:
        """When a replacement for a slice failed at `now` is ready (now, or a later return)."""
        if self.free is None:
            return now
        while self._returns and self._returns[0] <= now:  # repaired slices rejoin the pool
            self._returns.pop(0)
            self.free += 1
        bisect.insort(self._returns, now + self.repair_s)  # the failed slice goes to repair
        if self.free > 0:
            self.free -= 1
            return now
        # No spare: wait for the earliest repair in progress (this slice's own, if no other).
        return self._returns.pop(0)


TRACE_FORMAT = "one failure a line: SECONDS [UNIT], e.g. `200` or `200 3` (# starts a comment)"


def read_trace(path: Path) -> tuple[tuple[float, ...], tuple[int, ...] | None]:
    """A measured failure trace: one failure a line, `SECONDS [UNIT]` (# starts a comment).

    A bad line is refused with the file, its line number and the format (a bare int() error
    named neither); a trace without a failure too: it would silently simulate 100% goodput.
    """
    times, units = [], []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--trace {path}: cannot read it ({e})") from None
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            if len(fields) > 2:
                raise ValueError
            at = float(fields[0])
            unit = int(fields[1]) if len(fields) > 1 else -1
            if not 0 <= at < math.inf or (len(fields) > 1 and unit < 0):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--trace {path}, line {number}: {line.strip()!r} is not a failure; expected {TRACE_FORMAT}, "
                "SECONDS >= 0 and UNIT a learner or slice number >= 0"
            ) from None
        times.append(at)
        units.append(unit)
    if not times:
        raise ValueError(
            f"--trace {path} holds no failure (a run without one is 100% goodput); expected {TRACE_FORMAT}"
        )
    return tuple(times), (tuple(units) if min(units) >= 0 else None)
