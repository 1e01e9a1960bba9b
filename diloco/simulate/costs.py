"""The arithmetic of time costs: bytes on the wire, sync times, and a slow slice's toll.

Pure functions of the configuration; the engine calls them once per run.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from diloco.simulate.config import SECONDS_PER_YEAR, LinkConfig, OuterConfig, SimConfig, StragglerConfig

# Bits per parameter before zstd, as diloco.wire.codecs lays them out: int8 and int4 carry one
# 2-byte scale per block of 64 values.
# The link `diloco tune` and `diloco run --auto` plan for unless told: a datacenter-to-datacenter one.
LINK_BANDWIDTH, LINK_RTT = "1Gbit", "50ms"
CODEC_BITS = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 16 / 64, "int4": 4.0 + 16 / 64}


def bits_per_param(link: LinkConfig) -> float:
    if link.bits_per_param is not None:
        return link.bits_per_param
    if link.codec not in CODEC_BITS:
        raise ValueError(f"unknown codec {link.codec!r} (one of {', '.join(CODEC_BITS)})")
    return CODEC_BITS[link.codec]


def transfer_seconds(params: float, link: LinkConfig) -> float:
    """One-way time to move `params` parameters: bytes over bandwidth, plus half a round trip."""
    return params * bits_per_param(link) / (link.bandwidth_gbps * 1e9) + link.rtt_s / 2


@dataclass(frozen=True)
class SyncTimes:
    """How long one fragment's sync takes, and what it means for the outer loop."""

    fragment_bytes: float
    push_s: float  # a learner's delta of one fragment reaching the syncer
    pull_s: float  # the merged fragment coming back
    round_trip_s: float  # push + merge + pull
    full_pull_s: float  # every fragment: what a rejoining learner pulls
    sync_blocking_s: float  # synchronous DiLoCo's outer step: whole model pushed, merged, pulled
    push_interval_s: float  # H / P steps: a fragment's next push is due after this long
    effective_h: float  # H, or more when a fragment's round trip outlasts its push interval


def sync_times(link: LinkConfig, outer: OuterConfig, step_s: float) -> SyncTimes:
    frag_params = link.params / outer.fragments
    push = transfer_seconds(frag_params, link)
    pull = transfer_seconds(frag_params, link)
    trip = push + link.merge_s + pull
    interval = outer.inner_steps / outer.fragments * step_s
    period = outer.inner_steps * step_s
    # A fragment still in flight when its next push is due skips that push (diloco.compute), so
    # its sync period stretches to whole multiples of H steps; and a link that cannot carry the
    # whole model once per H steps stretches it in proportion.
    stretch = max(1.0, math.ceil(trip / period), transfer_seconds(link.params, link) / period)
    return SyncTimes(
        fragment_bytes=frag_params * bits_per_param(link) / 8,
        push_s=push,
        pull_s=pull,
        round_trip_s=trip,
        full_pull_s=transfer_seconds(link.params, link),
        sync_blocking_s=2 * transfer_seconds(link.params, link) + link.merge_s * outer.fragments,
        push_interval_s=interval,
        effective_h=outer.inner_steps * stretch,
    )


@functools.lru_cache(maxsize=256)
def expected_max_lognormal(n: int, sigma: float) -> float:
    """E[max of n iid LogNormal(0, sigma)]: the step time of n slices in lock-step, over one's.

    E[max] = integral over x > 0 of (1 - F(x)^n) dx; with x = exp(sigma z) it is a smooth integral
    over z, done on a grid (a few hundred points is exact to 1e-6 for the sigmas that matter).
    """
    if sigma <= 0:
        return 1.0
    if n <= 1:
        return math.exp(sigma * sigma / 2)
    lo, hi, steps = -8.0, 8.0 + math.sqrt(2 * math.log(n)), 4000
    dz = (hi - lo) / steps
    total = math.exp(sigma * lo)  # the part below lo, where F(x)^n is ~0
    for k in range(steps):
        z = lo + (k + 0.5) * dz
        cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
        tail = -math.expm1(n * math.log(cdf)) if cdf > 0 else 1.0
        total += tail * sigma * math.exp(sigma * z) * dz
    return total


def group_pace(slices: int, straggler: StragglerConfig, slow: bool) -> float:
    """Nominal step time over the step time of a lock-step group of `slices` slices (<= 1)."""
    factor = expected_max_lognormal(slices, straggler.jitter_sigma)
    if slow:
        factor *= straggler.slow_factor
    return 1.0 / factor


def slow_count(units: int, straggler: StragglerConfig) -> int:
    """How many of `units` are persistently slow."""
    if straggler.slow_factor <= 1.0 or straggler.slow_share <= 0:
        return 0
    return min(units, round(units * straggler.slow_share))


def failure_rate_per_s(cfg: SimConfig) -> float:
    """Failures per second of the whole job: N chips, each of rate 1 / MTBI."""
    return cfg.chips / (cfg.failure.mtbi_years * SECONDS_PER_YEAR)


_RATE = re.compile(r"^\s*([\d.]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit|b|bps|bit/s)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([\d.]+(?:e[+-]?\d+)?)\s*(ms|s|us)?\s*$", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """'5Gbit', '100Mbit', '1.5' (Gbit/s) -> Gbit/s."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"not a bandwidth: {text!r} (e.g. 1Gbit, 100Mbit, 2.5)")
    value, prefix = float(match.group(1)), match.group(2).lower()
    if not prefix and not match.group(3):
        return value
    return value * {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}[prefix]


def parse_duration(text: str) -> float:
    """'50ms', '0.05s', '0.05' (seconds) -> seconds."""
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 50ms, 0.05s)")
    value, unit = float(match.group(1)), (match.group(2) or "s").lower()
    return value * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
