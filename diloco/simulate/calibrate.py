"""The simulator's inputs measured on a real run: `diloco simulate --calibrate RUN_DIR`.

A `diloco run` workdir holds what it cost: summary.json (wall time, goodput, wire bytes by RPC,
the configuration), every learner life's start-up phases and its end in logs/learner-*.log
(diloco.compute.startup), local-state resumes (how old the state a restart came back to was),
and the coordinator's log (merge times, its own lives). From these, a Calibration:

- restart-to-first-step by phase, and the kill times (a restarted life began `total` before its
  first step: the supervisor respawns at once);
- the work lost per kill (the resumed state's age, less the time from the kill to the resume);
- step time and the share of a learner's life spent in steps; the job's start-up and wind-down;
- bytes per pushed and pulled fragment (bits per parameter on the wire, zstd included), merge time.

Two mappings follow. replay_config: the run itself, M learners of one "chip" each, to predict its
own goodput (the summary's definition: learner-seconds of kept steps over M x wall).
scaled_config: a large job's config with the measured parts put in, and what cannot be measured
here (the model's size, the link, the infrastructure's restart) kept as stated assumptions.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from diloco.compute.startup import PHASES, read_startups
from diloco.observe.events import METRICS_LOG, read_events
from diloco.simulate.config import (
    SECONDS_PER_YEAR,
    FailureConfig,
    LinkConfig,
    OuterConfig,
    RecoveryConfig,
    SimConfig,
)
from diloco.simulate.costs import CODEC_BITS

_STAMP = r"^(\S+ \S+) "
_DONE = re.compile(_STAMP + r".*learner done \(.*\): steps=(\d+) .*busy=([\d.]+)s wall=([\d.]+)s")
_RESUME = re.compile(_STAMP + r".*local state: resuming at step (\d+) from state ([\d.]+)s old")
_MERGE = re.compile(r"merge fragment=\d+ .* in ([\d.]+)s")
_LEARNER_PID = re.compile(r"\blearner\[(\d+)\]")
_PID = re.compile(_STAMP + r"\S+ coordinator\[(\d+)\]")


def _unit(name: str) -> int:
    """learner-3 (a process or its log's name) -> 3."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _at(stamp: str) -> float:
    """A log line's time, as diloco.logs writes it (local time, milliseconds after a comma)."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What one run measured. Times in seconds; kill times from the job's start."""

    run_dir: str
    learners: int
    wall_s: float
    goodput: float
    goodput_after_start: float
    job_startup_s: float
    wind_down_s: float
    step_s: float
    step_efficiency: float
    restarts: int
    restart_phases_s: dict[str, float]
    restart_total_s: float
    pull_s: float
    lost_per_kill_s: float
    state_every_s: float
    kill_times: tuple[float, ...]
    kill_units: tuple[int, ...]
    coordinator_kills: tuple[float, ...]
    coordinator_restart_s: float
    params: int
    fragments: int
    inner_steps: int
    overlap_steps: int
    quorum: int
    codec: str
    push_bytes: float
    pull_bytes: float
    bits_per_param: float
    merge_s: float
    kills: dict[str, int] = field(default_factory=dict)
    learner_tokens_per_s: float = 0.0  # all learners together, each over its own training time
    chunk_bytes: int = 0  # data.chunk_bytes: raw bytes per chunk
    tokens_per_chunk: float = 0.0  # tokens a chunk became, on average
    resumed: bool = False  # summary.json's resumed_from: this job went on from an earlier one's ledger

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Life:
    unit: int
    first_step_at: float
    phases: dict[str, float]
    done_at: float | None = None
    busy_s: float = 0.0
    wall_s: float = 0.0  # its training loop's own wall, from its end line (the final flush left out)
    steps: int = 0
    resume_age_s: float | None = None
    resume_at: float | None = None
    resumed_steps: int = 0  # where a resumed life began: its done line counts steps from 0, busy from here


def _lives(log: Path, unit: int) -> list[_Life]:
    """Every life in one learner's log that took a step, its lines tied to it by the process id.

    By pid, not by time: a learner restarted into a finishing run logs its end without a first
    step, and that end is its own (busy 0), not the killed life's before it.
    """
    lives: dict[str, _Life] = {}
    resumes: dict[str, tuple[float, int, float]] = {}
    dones: dict[str, tuple[float, int, float, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        pid = m.group(1) if (m := _LEARNER_PID.search(line)) else ""
        if startup := read_startups(line):
            lives[pid] = _Life(unit, startup[0].first_step_at, startup[0].phases)
        elif m := _RESUME.match(line):
            resumes[pid] = (_at(m.group(1)), int(m.group(2)), float(m.group(3)))
        elif m := _DONE.match(line):
            dones[pid] = (_at(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4)))
    for pid, life in lives.items():
        if pid in resumes:
            life.resume_at, life.resumed_steps, life.resume_age_s = resumes[pid]
        if pid in dones:
            life.done_at, life.steps, life.busy_s, life.wall_s = dones[pid]
    return sorted(lives.values(), key=lambda life: life.first_step_at)


def _coordinator(run: Path, started_at: float) -> tuple[list[float], list[float], list[float]]:
    """(kill times, restart durations, merge durations) of the coordinator.

    Each life after the first begins with a `start` event (epoch > 1) in metrics.jsonl, written
    once it serves. It was killed after the last thing the old life wrote: its last event (the
    progress samples and learner reports come every few seconds) or its last log line (a new pid
    is a new life), whichever is later.
    """
    events = sorted(read_events(run / METRICS_LOG), key=lambda e: e.get("at", 0.0))
    log = run / "logs" / "coordinator.log"
    last_lines: list[float] = []  # the last line of each coordinator life but the newest
    merges = []
    pid, last = None, None
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if m := _MERGE.search(line):
            merges.append(float(m.group(1)))
        if match := _PID.match(line):
            if pid is not None and match.group(2) != pid and last is not None:
                last_lines.append(last)
            pid, last = match.group(2), _at(match.group(1))
    kills, restarts = [], []
    for i, e in enumerate(events):
        if e.get("kind") != "start" or e.get("epoch", 1) <= 1 or i == 0:
            continue
        before = events[i - 1]["at"]
        lines = [t for t in last_lines if before <= t < e["at"]]
        killed = max([before, *lines])
        kills.append(killed - started_at)
        restarts.append(e["at"] - killed)
    return kills, restarts, merges


def read_calibration(run_dir: str | Path) -> Calibration:
    """Everything the simulator can take from a finished `diloco run` workdir."""
    run = Path(run_dir)
    path = run / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"{run} has no summary.json: is it a finished `diloco run` workdir?")
    s = json.loads(path.read_text())
    cfg = s.get("config", {})
    train, sync = cfg.get("train", {}), cfg.get("sync", {})
    lives: list[_Life] = []
    for log in sorted((run / "logs").glob("learner-*.log")):
        lives += _lives(log, _unit(log.stem))
    firsts: dict[int, _Life] = {}
    for life in lives:
        if life.unit not in firsts or life.first_step_at < firsts[life.unit].first_step_at:
            firsts[life.unit] = life
    job_startup = float(s.get("job_startup_seconds", 0.0))
    if "started_at" in s:  # the supervisor's wall clock at the job's start
        started_at = float(s["started_at"])
    else:  # an older summary: the mean first step, less the job's start-up
        started_at = (
            statistics.fmean(f.first_step_at for f in firsts.values()) - job_startup if firsts else 0.0
        )
    wall = float(s.get("wall_seconds", 0.0))
    restarts = [life for life in lives if firsts.get(life.unit) is not life]
    kill_at = {id(life): life.first_step_at - life.phases.get("total", 0.0) - started_at for life in restarts}
    lost = [
        max(0.0, life.resume_age_s - (life.resume_at - started_at - kill_at[id(life)]))
        for life in restarts
        if life.resume_age_s is not None and life.resume_at is not None
    ]
    ended = [life for life in lives if life.done_at is not None]
    # A life's steps share of its training loop's own wall. The run's final flush (the last pushes
    # and their merge, between the loop's end and the end line) is a one-time cost at the end: in
    # the wind-down, not spread over every step (a short final life made a 6-s flush look like a
    # 10% loss on every step of the run, and the replay under-predicted by 4 points).
    stepping = sum(life.wall_s for life in ended)
    flush = [max(0.0, life.done_at - life.first_step_at - life.wall_s) for life in ended]  # type: ignore[operator]
    busy = sum(life.busy_s for life in ended)
    steps = sum(life.steps - life.resumed_steps for life in ended)  # this life's steps, as busy is
    coord_kills, coord_restarts, merges = _coordinator(run, started_at)
    order = sorted(restarts, key=lambda life: kill_at[id(life)])
    kill_times = [kill_at[id(life)] for life in order]
    kill_units = [life.unit for life in order]
    if "kill_log" in s and "started_at" in s:
        # The supervisor's own record (a kill during a life's start-up leaves no start-up line to
        # infer it from): learner kills by unit, coordinator kills, from the job's start.
        logged = [(k["at"] - s["started_at"], k["role"], k["process"]) for k in s["kill_log"]]
        learner_kills = sorted((t, _unit(p)) for t, role, p in logged if role == "learner")
        kill_times, kill_units = [t for t, _ in learner_kills], [u for _, u in learner_kills]
        coord_kills = sorted(t for t, role, _ in logged if role == "coordinator")
    by_rpc = s.get("wire_bytes_by_rpc", {})
    push, pull = by_rpc.get("push", {}), by_rpc.get("pull", {})
    push_bytes = push.get("received", 0) / max(1, push.get("calls", 0))
    pull_bytes = pull.get("sent", 0) / max(1, pull.get("calls", 0))
    params = int(s.get("params", 0))
    fragments = int(sync.get("fragments", 1))
    phases = {p: statistics.fmean(v) for p in (*PHASES, "total")
              if (v := [life.phases[p] for life in restarts if p in life.phases])}  # fmt: skip
    return Calibration(
        run_dir=str(run),
        learners=int(s.get("learners", len(firsts) or 1)),
        wall_s=wall,
        # null in a resumed run's summary (its busy seconds hold earlier jobs'): not measured, 0
        goodput=float(s.get("goodput") or 0.0),
        goodput_after_start=float(s.get("goodput_after_start") or 0.0),
        job_startup_s=job_startup,
        wind_down_s=max(0.0, started_at + wall - statistics.fmean(life.done_at for life in ended))  # type: ignore[misc]
        + statistics.fmean(flush)
        if ended
        else 0.0,
        step_s=busy / steps if steps else 0.0,
        step_efficiency=min(1.0, busy / stepping) if stepping > 0 else 1.0,
        restarts=len(restarts),
        restart_phases_s=phases,
        restart_total_s=phases.get("total", 0.0),
        pull_s=phases.get("pull", 0.0),
        lost_per_kill_s=statistics.fmean(lost) if lost else 0.0,
        state_every_s=float(train.get("local_state_every_s", 0.0)),
        kill_times=tuple(round(t, 3) for t in kill_times),
        kill_units=tuple(kill_units),
        coordinator_kills=tuple(round(t, 3) for t in coord_kills),
        coordinator_restart_s=statistics.fmean(coord_restarts) if coord_restarts else 0.0,
        params=params,
        fragments=fragments,
        inner_steps=int(train.get("inner_steps", 50)),
        overlap_steps=int(sync.get("overlap_steps", 0)),
        quorum=max(1, int(sync.get("quorum", 1))),
        codec=str(sync.get("codec", "fp32")),
        push_bytes=push_bytes,
        pull_bytes=pull_bytes,
        bits_per_param=push_bytes * 8 / (params / fragments) if params else 0.0,
        merge_s=statistics.fmean(merges) if merges else 0.0,
        kills=dict(s.get("kills", {})),
        learner_tokens_per_s=float(s.get("learner_tokens_per_s", 0.0)),
        chunk_bytes=int(cfg.get("data", {}).get("chunk_bytes", 0)),
        tokens_per_chunk=s.get("tokens_prepared", 0) / max(1, s.get("chunks_done", 0)),
        resumed=s.get("resumed_from") is not None,
    )


def check_whole_job(cal: Calibration) -> None:
    """Refuse to simulate from a resumed run: its learner logs hold the earlier jobs' lives too
    (their kills, restarts and final flushes), its summary's goodput is not measured (null), and
    the costs read from them mixed two jobs (goodput 0.0%, a loss per kill with no kill, a 55 s
    wind-down). `diloco tune` still reads it: a step time and a model size do not mix."""
    if cal.resumed:
        raise ValueError(
            f"--calibrate {cal.run_dir}: a resumed run (summary.json resumed_from is set): its logs and "
            "counts mix this job with the earlier one(s), so its costs and goodput are not this job's; "
            "calibrate from a run started afresh in a new workdir"
        )


def replay_config(
    cal: Calibration,
    *,
    seed: int = 0,
    kill_every_s: float | None = None,
    coordinator_every_s: float | None = None,
) -> SimConfig:
    """The run itself as a simulated job: M learners of one chip each, its measured costs.

    With kill_every_s (mean seconds between kills of each learner) failures are a Poisson
    process at that rate (what the chaos supervisor draws); without it, the run's own kill times.
    """
    check_whole_job(cal)
    m = cal.learners
    if kill_every_s:
        failure = FailureConfig(
            mtbi_years=kill_every_s / SECONDS_PER_YEAR, coordinator_mtbi_s=coordinator_every_s
        )
    else:
        failure = FailureConfig(
            trace=cal.kill_times, trace_units=cal.kill_units,
            coordinator_trace=cal.coordinator_kills or None,
        )  # fmt: skip
    # The rule loses (save interval / 2 + lag) on average: the lag is what the measured loss adds.
    lag = max(0.0, cal.lost_per_kill_s - cal.state_every_s / 2) if cal.restarts else 0.0
    return SimConfig(
        chips=m, learners=m, slice_chips=1, hours=cal.wall_s / 3600, seed=seed,
        step_s=max(cal.step_s, 1e-3), step_efficiency=max(cal.step_efficiency, 1e-3),
        job_startup_s=cal.job_startup_s, wind_down_s=cal.wind_down_s,
        failure=failure,
        recovery=RecoveryConfig(
            restart_s=0.0, startup_s=max(0.0, cal.restart_total_s - cal.pull_s), rejoin_pull_s=cal.pull_s,
            state_every_s=cal.state_every_s, state_lag_s=lag, state_survives=cal.state_every_s > 0,
            coordinator_restart_s=cal.coordinator_restart_s,
        ),
        link=LinkConfig(params=max(cal.params, 1), codec=cal.codec, bits_per_param=cal.bits_per_param or None,
                        bandwidth_gbps=8.0, rtt_s=1e-4, merge_s=cal.merge_s),
        outer=OuterConfig(inner_steps=cal.inner_steps, fragments=cal.fragments,
                          overlap_steps=cal.overlap_steps, quorum=cal.quorum),
    )  # fmt: skip


# What scaled_config keeps from a calibration, and what it leaves to the stated assumptions.
SCALED_ASSUMPTIONS = (
    "software start-up after a restart (imports, join, model build, first batch, first step) as measured here",
    "the share of a learner's time in steps, and the save lag of its kept state, as measured here",
    "bits per parameter on the wire as measured here when the codec is the same (else the codec's nominal size)",
    "merge throughput per syncer shard as measured here, the syncer sharded over `syncer_shards` hosts",
    "the model's size, the link, the infrastructure's restart (spare, scheduling) and the step time: assumed",
)


def scaled_config(cal: Calibration, base: SimConfig, *, syncer_shards: int = 64) -> SimConfig:
    """A large job (`base`) with the calibration's measured parts in place."""
    check_whole_job(cal)
    software = sum(cal.restart_phases_s.get(p, 0.0) for p in PHASES if p not in ("process", "pull"))
    # zstd's gain depends on the codec (fp32 exponents compress, packed int4 hardly): only the
    # same codec's measurement carries over.
    bits = cal.bits_per_param if cal.bits_per_param > 0 and cal.codec == base.link.codec else None
    frag_bytes = base.link.params / base.outer.fragments * (bits or CODEC_BITS[base.link.codec]) / 8
    merge_rate = cal.push_bytes / cal.merge_s if cal.merge_s > 0 and cal.push_bytes > 0 else None
    merge_s = frag_bytes / (merge_rate * max(1, syncer_shards)) if merge_rate else base.link.merge_s
    return replace(
        base,
        step_efficiency=max(min(cal.step_efficiency, 1.0), 1e-3),
        recovery=replace(
            base.recovery,
            startup_s=software,
            state_lag_s=max(0.0, cal.lost_per_kill_s - cal.state_every_s / 2) if cal.restarts else 0.0,
        ),
        link=replace(base.link, bits_per_param=bits, merge_s=merge_s),
    )
