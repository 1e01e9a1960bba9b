"""The arithmetic of a run's summary: pure functions of the coordinator's status detail, the
learners' logs and the configuration (what `diloco run` writes to summary.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.compute.startup import read_startups
from diloco.config import RunConfig


def data_plane_metrics(d: dict[str, Any], train_seconds: float) -> dict[str, Any]:
    """summary.json's data-plane numbers, from the coordinator's status detail.

    data_tokens_per_s: tokens written into shards by all data workers per wall second of the run;
    data_tokens_per_s_by_worker: each data worker's tokens per second of work on its chunks (its
    speed, whatever share of the run it was busy); data_stall_by_learner: each learner's share of
    its wall time spent waiting for data.
    """
    workers = d.get("workers", [])
    return {
        "data_tokens_per_s": round(d.get("tokens_prepared", 0) / max(train_seconds, 1e-9), 1),
        "data_tokens_per_s_by_worker": {
            w["worker_id"]: w.get("tokens_per_s", 0.0) for w in workers if w["role"] == "data"
        },
        "data_stall_by_learner": {
            w["worker_id"]: round(w.get("data_stall_seconds", 0.0) / w["wall_seconds"], 4)
            for w in workers
            if w["role"] == "compute" and w.get("wall_seconds")
        },
    }


def ddp_wire_bytes_per_token(params: int, workers: int, batch_size: int, seq_len: int) -> float:
    """What DDP moves per trained token with the same model, batch and workers: a ring all-reduce
    of fp32 gradients every step, in which each of N ranks sends (and receives) 2(N−1)/N × 4 bytes
    per parameter. Each byte is counted once, as diloco's wire bytes are (sent by one side,
    received by the other)."""
    if workers < 2:
        return 0.0
    per_step = workers * (2 * (workers - 1) / workers) * 4 * params
    return per_step / (workers * batch_size * (seq_len + 1))


def goodput(
    kept_busy_seconds: float, tokens_merged: int, tokens_pushed: int, learners: int, wall_s: float
) -> float:
    """The share of learner-seconds whose work was merged, over learners × wall time.

    The work is time in inner steps, every life of every learner, that a kill did not lose: steps
    whose rows rode on a push, or that were in the learner's local state on disk when it died
    (each learner reports that figure, `kept_busy_seconds`, in its heartbeats). Of the pushed
    work, the share of tokens that merged counts (refused or dropped pushes do not).

    Merged tokens per second alone would hide what a failure costs on shared cores: a dead
    learner's core goes to the others, who then train faster. Work lost to a kill and time spent
    dead or restarting both count against goodput.
    """
    if learners <= 0 or wall_s <= 0 or tokens_pushed <= 0:
        return 0.0
    merged_share = min(1.0, tokens_merged / tokens_pushed)
    return round(min(1.0, kept_busy_seconds * merged_share / (learners * wall_s)), 4)


# Above this H, a run from a random init tends to end worse than it began (issue 6's note, and the
# README's H = 500 figures): see cold_start_warning.
COLD_START_MAX_H = 200


def job_startup_seconds(log_dir: Path, started_at: float) -> float:
    """Mean over learners of the time from the job's start to their first inner step (first life)."""
    firsts = []
    for log in sorted(log_dir.glob("learner-*.log")):
        lives = read_startups(log.read_text(errors="replace"))
        if lives:
            firsts.append(max(0.0, lives[0].first_step_at - started_at))
    return sum(firsts) / len(firsts) if firsts else 0.0


def cold_start_warning(cfg: RunConfig) -> str | None:
    """Why a large H from a random init is a bad idea, or None.

    From a random init, a learner's first few hundred AdamW steps move it far from where it
    started and into its own basin; the average of such far-apart models (what an outer step
    takes) is no longer a good model, so each merge undoes much of what was learned. DiLoCo's
    large H is meant for a warm start (the DiLoCo paper begins from a pretrained checkpoint).
    """
    if cfg.train.inner_steps <= COLD_START_MAX_H or cfg.model.init_from:
        return None
    return (
        f"H = {cfg.train.inner_steps} from a random init: the first merges average models that moved far "
        f"apart, and such runs have ended above where they began. Train a few thousand steps at H <= "
        f"{COLD_START_MAX_H} first and start from that model (--set model.init_from=runs/<name>/model.safetensors)."
    )


def mean_of(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
