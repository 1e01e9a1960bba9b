"""`diloco tune`: H, fragments P, overlap tau, the codec and the data chunk size for a measured
step time and a given link, from the simulator's own sync-time model (costs.sync_times).

The choice, in order of what costs model quality most (this project's measurements):
- H: the smallest of 50, 100, 200, 500 whose syncs the link carries with room to spare (the
  whole model once per H steps at most LINK_LOAD of the bandwidth). Larger H means fewer outer
  steps; from a random init H > 200 has ended worse (README, H = 500 runs). H below 50 is not
  proposed: the outer optimizer's defaults were tuned at 50.
- the codec: at that H, the most precise one that fits (int4 against fp32 at equal tokens moved
  the eval loss by +0.34% on average, benchmarks/codec_loss.py; staying precise is still free).
- tau: the steps a fragment's round trip (push, merge, pull) takes, plus one, and never fewer
  than the default: the sync hides behind compute, and past sync.grace_steps a longer tau widens
  the grace window (max(tau, grace_steps) steps), which keeps rounds whole (fewer single-push
  rounds: the README's outer_sim figures).
- P: the fewest fragments (at least 2, the default) whose merge is back, tau steps after its
  push, before the next fragment's push is due (tau <= H / P).
- chunk size: the run's own, unless one learner trains through a chunk in less than CHUNK_MIN_S
  (a lease round trip every few seconds); then the smallest power of two that lasts that long.
  Never larger than that: a learner's batches mix rows of its few open shards, and a larger chunk
  makes each a longer stretch of one document (measured: `--auto` arms whose only change was
  256 KiB -> 1 MiB chunks ended 0.7% above the defaults, mean of four seed and link pairs,
  README "On shaped links"). The data's bytes on the link do not depend on the chunk size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from diloco.config_checks import CODECS  # most precise first
from diloco.errors import DilocoError
from diloco.simulate.config import LinkConfig, OuterConfig
from diloco.simulate.costs import CODEC_BITS, sync_times, transfer_seconds

H_CHOICES = (50, 100, 200, 500)
P_CHOICES = (2, 4, 8, 16)
LINK_LOAD = 0.4  # at most this share of the link carries syncs: room for rejoin pulls, and a round
# trip (twice a fragment's push time) still shorter than a push interval
CHUNK_MIN_S = 10.0
DEFAULTS = OuterConfig()  # this project's defaults (H 50, P 2, tau 2) beside fp32


@dataclass(frozen=True)
class Choice:
    """One recommended setting, what it was, and what it costs and buys."""

    name: str
    default: str
    value: str
    why: str


@dataclass(frozen=True)
class Tuning:
    inner_steps: int
    fragments: int
    overlap_steps: int
    codec: str
    chunk_bytes: int | None
    choices: list[Choice]
    fits: bool  # False: even int4 at H = 500 overloads the link
    step_s: float = 0.0  # what it was tuned for: seconds per inner step
    params: float = 0.0  # and the model's size

    def overrides(self) -> list[str]:
        """The `--set` flags of `diloco run` that apply it."""
        out = [f"train.inner_steps={self.inner_steps}", f"sync.fragments={self.fragments}",
               f"sync.overlap_steps={self.overlap_steps}", f"sync.codec={self.codec}",
               f"sync.pull_codec={self.codec}"]  # fmt: skip
        if self.chunk_bytes:
            out.append(f"data.chunk_bytes={self.chunk_bytes}")
        return out


def link_load(link: LinkConfig, h: int, step_s: float) -> float:
    """The share of the link the syncs take: the whole model each way once per H steps."""
    return (transfer_seconds(link.params, link) - link.rtt_s / 2) / (h * step_s)


def check_inputs(
    *,
    step_s: float | None = None,
    params: float | None = None,
    bandwidth_gbps: float = 1.0,
    rtt_s: float = 0.0,
    learners: int = 1,
) -> None:
    """Refuse what no step, model or link can be (a negative step time gave "a push every
    -25.0 s"), naming `diloco tune`'s flag; None: measured later (--calibrate)."""
    problems = [
        f"{flag} must be > 0, got {value:g}"
        for flag, value in (("--step-s", step_s), ("--params", params), ("--bandwidth", bandwidth_gbps))
        if value is not None and not 0 < value < math.inf  # NaN and inf too
    ]
    if not 0 <= rtt_s < math.inf:
        problems.append(f"--rtt must be >= 0, got {rtt_s:g} s")
    if learners < 1:
        problems.append(f"--learners must be >= 1, got {learners}")
    if problems:
        raise DilocoError("; ".join(problems))


def recommend(
    *,
    step_s: float,
    link: LinkConfig,
    tokens_per_s: float = 0.0,
    tokens_per_chunk: float = 0.0,
    chunk_bytes: int = 0,
) -> Tuning:
    """Settings for one learner of step_s per inner step behind `link` (pure arithmetic).

    tokens_per_s: one learner's training speed; with tokens_per_chunk (what a chunk of
    chunk_bytes became) it sizes the data chunks.
    """
    check_inputs(step_s=step_s, params=link.params, bandwidth_gbps=link.bandwidth_gbps, rtt_s=link.rtt_s)
    fits = True
    pick = next(
        ((h, c) for h in H_CHOICES for c in CODECS
         if link_load(replace(link, codec=c, bits_per_param=None), h, step_s) <= LINK_LOAD),
        None,
    )  # fmt: skip
    if pick is None:
        fits, pick = False, (H_CHOICES[-1], CODECS[-1])
    h, codec = pick
    chosen = replace(link, codec=codec, bits_per_param=None)
    late = False
    for p in (q for q in P_CHOICES if h // q >= 2):
        trip = _trip(chosen, h, p, step_s)
        tau = max(DEFAULTS.overlap_steps, math.ceil(trip / step_s) + 1)
        if tau <= h // p:
            break
    else:  # even the most fragments cannot bring a merge back before the next push: it comes late
        late, tau = True, h // p
    default_load = link_load(replace(link, codec="fp32", bits_per_param=None), DEFAULTS.inner_steps, step_s)
    choices = [
        Choice("H (train.inner_steps)", str(DEFAULTS.inner_steps), str(h),
               f"syncs take {_load(link_load(chosen, h, step_s))} (fp32 at H = {DEFAULTS.inner_steps}: "
               f"{_load(default_load)}); " + ("the smallest H that fits" if h == H_CHOICES[0] else
               "fewer outer steps than the default: may cost quality (not measured here; benchmarks/quality.py "
               "compares)")),
        Choice("codec (sync.codec, sync.pull_codec)", "fp32", codec,
               f"{CODEC_BITS[codec]:.2f} bits/param on the wire before zstd; the most precise that fits at this H"
               + ("" if codec == "fp32" else " (int4 vs fp32 measured +0.34% eval loss at equal tokens)")),
        Choice("P (sync.fragments)", str(DEFAULTS.fragments), str(p),
               f"a fragment's round trip {_secs(trip)} against a push every {_secs(h / p * step_s)}; "
               "more fragments spread the bytes, each a smaller outer step"),
        Choice("tau (sync.overlap_steps)", str(DEFAULTS.overlap_steps), str(tau),
               (f"the round trip outlasts {tau} steps ({tau * step_s:.1f} s): merges come late (staleness, no wait)"
                if late else f"the round trip hides behind {tau} steps ({tau * step_s:.1f} s): no learner waits; "
                f"each merge is applied {tau} steps after its push")),
    ]  # fmt: skip
    size = None
    if tokens_per_s > 0 and tokens_per_chunk > 0 and chunk_bytes > 0:
        size, lasts = _chunk_size(chunk_bytes, tokens_per_chunk / tokens_per_s)
        why = (f"one learner trains a chunk in ~{lasts:.0f} s at {tokens_per_s:,.0f} tokens/s: "
               + ("a lease every few seconds was the smallest size lasting that long" if size != chunk_bytes
                  else "leases are already few; larger chunks would make each batch longer stretches of one "
                  "document"))  # fmt: skip
        choices.append(Choice("chunk size (data.chunk_bytes)", str(chunk_bytes), str(size), why))
    if not fits:
        choices.append(Choice("warning", "", "", "even int4 at H = 500 takes more than half the link"))
    return Tuning(h, p, tau, codec, size, choices, fits, step_s=step_s, params=link.params)


def _load(share: float) -> str:
    """A share of the link: a percentage, or a multiple past 10x (1e30 params printed
    `425000000000000065536%`)."""
    return f"{share:.0%} of the link" if share < 10 else f"{share:.3g} times the link's capacity"


def _secs(seconds: float) -> str:
    """Seconds to one decimal, in three significant digits once that would be a long number."""
    return f"{seconds:.1f} s" if seconds < 1e5 else f"{seconds:.3g} s"


def _chunk_size(chunk_bytes: int, chunk_s: float) -> tuple[int, float]:
    """The run's chunk size, or the smallest power of two one learner trains through in at least
    CHUNK_MIN_S when a chunk lasts less (chunk_s: how long one lasts now); and how long it lasts."""
    size = chunk_bytes
    while size * chunk_s / chunk_bytes < CHUNK_MIN_S and size < 1 << 30:
        size = 1 << size.bit_length() if size & (size - 1) else size * 2
    return size, size * chunk_s / chunk_bytes


def _trip(link: LinkConfig, h: int, p: int, step_s: float) -> float:
    return sync_times(link, OuterConfig(inner_steps=h, fragments=p), step_s).round_trip_s


def recommend_for_run(
    run_dir: str,
    *,
    bandwidth_gbps: float,
    rtt_s: float,
    learners: int,
    step_s: float | None = None,
    params: float | None = None,
) -> Tuning:
    """`recommend` with what an earlier `diloco run` measured (diloco.simulate.calibrate): its step
    time, model size, merge time, and its tokens per chunk and per second for the chunk size. The
    learners' tokens/s is shared by `learners`. step_s and params, given, replace the measured ones."""
    from diloco.simulate.calibrate import read_calibration

    check_inputs(step_s=step_s, params=params, bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s, learners=learners)
    cal = read_calibration(run_dir)
    step, size = step_s or cal.step_s, params or cal.params
    if not step or not size:
        raise ValueError(f"{run_dir}: no step time or model size measured (did its learners train?)")
    link = LinkConfig(params=size, bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s, merge_s=cal.merge_s)
    return recommend(
        step_s=step, link=link, tokens_per_s=cal.learner_tokens_per_s / max(1, learners),
        tokens_per_chunk=cal.tokens_per_chunk, chunk_bytes=cal.chunk_bytes,
    )  # fmt: skip
