"""The simulator's inputs: one keyword-only dataclass per part, each field with its default's source.

Defaults and where they come from (every one not measured here is an assumption, and the README
lists them beside the table):

- Failure rate: one interruption per chip-year (the Decoupled DiLoCo paper's setting, arXiv
  2604.21428). For scale: the Llama 3 paper (arXiv 2407.21783) reports 466 job interruptions in
  54 days on 16,384 GPUs (419 unexpected, ~78% of those hardware), one per ~2.8 h, i.e. one per
  ~5.2 GPU-years: the paper's setting is five times harsher than Llama 3's fleet.
- Recovery: the Gemini 2.5 report describes slice-granularity elasticity whose reconfiguration
  costs on the order of tens of seconds per interruption, against ten minutes or more when a job
  waits for healthy machines to be rescheduled. We could not check its exact figures here, so
  `restart_s` (30 s: a hot spare swapped in and the program restarted from in-memory state) and
  `reconfigure_s` (10 s) are assumptions in that spirit; `restart_s=600` is the no-spare case.
- Model and link: 12 B parameters over 5 Gbit/s (the paper's cross-region run: a 12 B model over
  2-5 Gbit/s of wide-area network, as reported in its announcement), int4 deltas, 50 ms RTT.
- The outer loop: this project's defaults (H = 50, P = 2, tau = 2, K = 1), taken from diloco.config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from diloco.config import SyncConfig, TrainConfig

SECONDS_PER_YEAR = 365.25 * 24 * 3600
# What SimConfig.check() lets through: every failure is drawn up front and walked one by one
# (about 16 us each with 16 learners), so these bound a run to about a minute and its memory to
# tens of MB. The paper's largest job is 2.4 M chips: ~6,600 failures a day.
MAX_FAILURES = 1_000_000
MAX_CHIPS = 10**9
MAX_LEARNERS = 10_000
MAX_SLICES = 10_000_000


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How chips fail."""

    mtbi_years: float = 1.0
    """Mean time between interruptions of one chip, in years (Poisson unless weibull_shape)."""
    weibull_shape: float | None = None
    """Weibull shape k of each slice's time between failures (k < 1: infant mortality, k > 1:
    wear-out); None: Poisson. Each slice is a renewal process of mean MTBI / chips per slice."""
    trace: tuple[float, ...] | None = None
    """Measured failure times (seconds from the start) instead of a random process."""
    trace_units: tuple[int, ...] | None = None
    """For each trace time, the learner (or slice) it hit; None: a uniformly random one."""
    coordinator_mtbi_s: float | None = None
    """Mean seconds between coordinator failures (Poisson); None: the coordinator never fails."""
    coordinator_trace: tuple[float, ...] | None = None
    """Measured coordinator failure times instead of coordinator_mtbi_s."""


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """What a failure costs to come back from."""

    restart_s: float = 30.0
    """From a failure to the failed program running again: a hot spare slice swapped in, the
    program (the whole job for DP, one learner for DiLoCo) restarted, state loaded from in-memory
    replicas. Assumption (see the module docstring)."""
    startup_s: float = 0.0
    """Software start-up after restart_s, up to the first step, the pull of global state aside
    (process, imports, join, model build, first batch, first step). Measured by --calibrate."""
    reconfigure_s: float = 10.0
    """Elastic DP's pause to drop a failed slice and go on smaller. Assumption."""
    repair_s: float = 3600.0
    """How long a failed slice is out of service before it is back (elastic DP runs without it
    that long; a bounded spare pool refills at this pace). Assumption."""
    spares: int | None = None
    """Hot spare slices; None: always one at hand. With a number, a restart that finds none waits
    for the next repaired slice."""
    state_every_s: float = 0.0
    """How often a program's training state is kept where a failure does not lose it (in-memory
    replicas, local disk): 0 means every step, so a failure loses only the step in progress."""
    state_lag_s: float = 0.0
    """How long after a save it is safe (the write's own time): the state a failure falls back to
    is at least this old. Measured by --calibrate (local state on disk)."""
    state_survives: bool = True
    """Whether a DiLoCo learner's kept state survives its failure. False: it falls back to its last
    complete set of landed pushes (every fragment pushed since). DP's kept state (its checkpoint)
    always survives."""
    rejoin_pull_s: float | None = None
    """Seconds a restarted learner spends pulling the global model; None: from the link model."""
    coordinator_restart_s: float = 30.0
    """From a coordinator failure to it serving again from its durable ledger. Assumption."""


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """The model on the wire: how long one fragment takes to travel (costs.sync_seconds)."""

    params: float = 12e9
    """Model parameters (12 B: the paper's cross-region run)."""
    codec: str = "int4"
    """How deltas and merged fragments travel: fp32 | bf16 | int8 | int4 (diloco.wire.codecs)."""
    bits_per_param: float | None = None
    """Measured bits per parameter on the wire (after zstd); None: the codec's nominal size."""
    bandwidth_gbps: float = 5.0
    """Each learner's link to the syncer, in Gbit/s (the paper's run: 2-5 Gbit/s)."""
    rtt_s: float = 0.05
    """Round-trip time of that link, in seconds."""
    merge_s: float = 0.0
    """Coordinator time to fold one push and publish a fragment (measured by --calibrate)."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer loop of DiLoCo (this project's defaults: a run's own, from diloco.config)."""

    inner_steps: int = TrainConfig.inner_steps
    """H: inner steps between two syncs of a fragment."""
    fragments: int = SyncConfig.fragments
    """P: parameter fragments, one pushed every H / P steps."""
    overlap_steps: int = SyncConfig.overlap_steps
    """tau: steps between a push and the application of its merge (Decoupled keeps training)."""
    quorum: int = SyncConfig.quorum
    """K: pushes a round needs; fewer live learners than K halt merging."""
    halt_bound_s: float = SyncConfig.max_unreachable_s
    """How long learners keep stepping while merging is halted (coordinator down, or fewer than K
    learners alive) before they stop: sync.max_unreachable_s."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Slow chips: a synchronous group steps at the pace of its slowest slice."""

    jitter_sigma: float = 0.0
    """Per-step log-normal noise (sigma) of each slice's step time; a group of n slices takes the
    expected maximum of n draws per step."""
    slow_share: float = 0.0
    """Share of slices (DP) or learners (DiLoCo) that are persistently slower."""
    slow_factor: float = 1.0
    """How much slower they are (step time multiplier)."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated job."""

    chips: int = 1_200_000
    """Chips allocated to the job."""
    learners: int = 8
    """M: DiLoCo learners (ignored when chips_per_learner is set)."""
    chips_per_learner: int | None = None
    """Chips per learner; M = chips // chips_per_learner."""
    slice_chips: int = 256
    """Chips that fail together and that elastic DP drops and re-adds as one (a few hosts' worth
    of accelerators on one interconnect). Assumption."""
    hours: float = 24.0
    """Simulated wall time."""
    seed: int = 0
    """Seed of every random draw: the same seed, the same run."""
    step_s: float = 2.0
    """Nominal time of one inner (or DP) step. Assumption for a large model."""
    dp_exposed_comm_s: float = 0.0
    """DP's all-reduce time per step not hidden behind compute (0: one datacenter, overlapped)."""
    step_efficiency: float = 1.0
    """Share of a stepping program's time inside its steps (data stalls, syncs on the training
    thread aside). Measured by --calibrate."""
    job_startup_s: float = 0.0
    """The job's own start-up before its first step, paid once (measured by --calibrate)."""
    wind_down_s: float = 0.0
    """Time at the end of the job with no steps (final pushes, exit), paid once."""
    failure: FailureConfig = field(default_factory=FailureConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    @property
    def m(self) -> int:
        """The number of DiLoCo learners."""
        if self.chips_per_learner:
            return max(1, self.chips // self.chips_per_learner)
        return max(1, self.learners)

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    @property
    def slices(self) -> int:
        """Slices of the whole job (at least one per learner)."""
        return max(self.m, self.chips // max(1, self.slice_chips))

    def with_(self, **changes: object) -> SimConfig:
        """A copy with some top-level fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def expected_failures(self) -> float:
        """Chip failures a run draws on average: N chips x T / MTBI (a Weibull slice's renewals
        average the same over a long horizon). Every one is drawn up front and walked in time."""
        return self.chips * self.horizon_s / (self.failure.mtbi_years * SECONDS_PER_YEAR)

    def check(self) -> None:
        """Refuse inputs that make no sense, or that the simulator cannot run in minutes, with the
        reason and the field's name: every problem at once, so one line names each."""
        problems: list[str] = []
        f, r, link, o, s = self.failure, self.recovery, self.link, self.outer, self.straggler

        def finite(name: str, value: float | None, *, low: float = 0.0, strict: bool = True) -> bool:
            # `not low < x < inf` also catches NaN, which every plain comparison lets through.
            if value is None:
                return True
            ok = (low < value if strict else low <= value) and value < math.inf
            if not ok:
                problems.append(f"{name} must be {'>' if strict else '>='} {low:g}, got {value:g}")
            return ok

        if not 1 <= self.chips <= MAX_CHIPS:
            problems.append(f"chips must be in [1, {MAX_CHIPS:.0e}], got {self.chips:g}")
        if self.learners < 1:
            problems.append(f"learners must be >= 1, got {self.learners}")
        elif 1 <= self.chips <= MAX_CHIPS and not self.m <= min(self.chips, MAX_LEARNERS):
            # Each learner needs a chip; the engine keeps every learner and visits all of them at
            # each failure, so tens of thousands make a run take hours.
            problems.append(f"learners (M) must be <= chips and <= {MAX_LEARNERS:,}, got M = {self.m:,} "
                            f"for {self.chips:,} chips")  # fmt: skip
        if self.slice_chips < 1:
            problems.append(f"slice_chips must be >= 1, got {self.slice_chips}")
        hours_ok = finite("hours", self.hours)
        finite("step_s", self.step_s)
        finite("dp_exposed_comm_s", self.dp_exposed_comm_s, strict=False)
        if not 0 < self.step_efficiency <= 1:
            problems.append(f"step_efficiency must be in (0, 1], got {self.step_efficiency}")
        finite("job_startup_s", self.job_startup_s, strict=False)
        finite("wind_down_s", self.wind_down_s, strict=False)
        # failures
        mtbi_ok = finite("mtbi_years", f.mtbi_years)
        finite("weibull_shape", f.weibull_shape)
        finite("coordinator_mtbi_s", f.coordinator_mtbi_s)
        drawn = f.trace is None and hours_ok and mtbi_ok and 1 <= self.chips <= MAX_CHIPS
        if drawn and self.expected_failures > MAX_FAILURES:
            # Drawn up front (failures.chip_failures): 1e20 chips asked numpy for 81 PiB, 1e12 ran
            # for ever. A million failures take about a minute per mode.
            problems.append(
                f"chips x hours / mtbi_years gives {self.expected_failures:.3g} expected failures per run, "
                f"over the simulator's cap of {MAX_FAILURES:,}: lower chips or hours, or raise mtbi_years"
            )
        elif drawn and f.weibull_shape is not None and f.weibull_shape != 1.0 and self.slices > MAX_SLICES:
            # A Weibull shape draws one renewal process per slice, each an array entry.
            problems.append(
                f"weibull_shape draws one process per slice: {self.slices:,} slices (chips / slice_chips) "
                f"is over the cap of {MAX_SLICES:,}: raise slice_chips or drop weibull_shape"
            )
        if f.coordinator_mtbi_s and hours_ok and self.horizon_s / f.coordinator_mtbi_s > MAX_FAILURES:
            problems.append(
                f"hours / coordinator_mtbi_s gives {self.horizon_s / f.coordinator_mtbi_s:.3g} coordinator "
                f"failures, over the cap of {MAX_FAILURES:,}: raise coordinator_mtbi_s"
            )
        if f.trace is not None and any(not -math.inf < t < math.inf for t in f.trace):
            problems.append("trace: every failure time must be a finite number of seconds")
        if f.trace_units is not None and min(f.trace_units, default=0) < 0:
            problems.append("trace_units must be >= 0")
        # recovery: durations are >= 0 (a negative restart credited work while down: dp 100%)
        for name in ("restart_s", "startup_s", "reconfigure_s", "repair_s", "state_every_s", "state_lag_s",
                     "rejoin_pull_s", "coordinator_restart_s"):  # fmt: skip
            finite(name, getattr(r, name), strict=False)
        if r.spares is not None and r.spares < 0:
            problems.append(
                f"spares must be >= 0 (or unbounded: None, -1 on the command line), got {r.spares}"
            )
        # the link
        finite("params", link.params)
        finite("bandwidth_gbps", link.bandwidth_gbps)
        finite("rtt_s", link.rtt_s, strict=False)
        finite("merge_s", link.merge_s, strict=False)
        finite("bits_per_param", link.bits_per_param)
        # the outer loop
        if o.fragments < 1 or o.inner_steps < 1:
            problems.append("inner_steps and fragments must be >= 1")
        if o.overlap_steps < 0:
            problems.append(f"overlap_steps (tau) must be >= 0, got {o.overlap_steps}")
        if o.quorum < 1:
            problems.append(f"quorum must be >= 1, got {o.quorum}")
        elif o.quorum > self.m:
            # K pushes a round cannot come from fewer learners: merging would never happen.
            problems.append(f"quorum (K = {o.quorum}) must be <= learners (M = {self.m})")
        finite("halt_bound_s", o.halt_bound_s, strict=False)
        # stragglers
        finite("jitter_sigma", s.jitter_sigma, strict=False)
        if not 0 <= s.slow_share <= 1:
            problems.append(
                f"slow_share must be in [0, 1] (a share of slices or learners), got {s.slow_share:g}"
            )
        if not 1 <= s.slow_factor < math.inf:
            # A step-time multiplier of the slow ones: below 1 they would be faster (it was ignored).
            problems.append(f"slow_factor must be >= 1 (how much slower), got {s.slow_factor:g}")
        if problems:
            raise ValueError("; ".join(problems))
