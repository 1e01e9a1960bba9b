"""A local run's summary (what `diloco run` writes to summary.json): the arithmetic on the
coordinator's status detail, the learners' logs and the configuration, the ledger's own report,
and the final model evaluated on the held-out split."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from diloco.compute.startup import read_startups
from diloco.config import RunConfig
from diloco.coordinator.pusher_watch import WATCH_FIGURES
from diloco.coordinator.report import longest_merge_gap, rounds_by_pushes, trained_param_count
from diloco.local.options import learner_id
from diloco.local.outcome import RecordedRun
from diloco.local.stopping import (
    finish_reason,
    learner_ends,
    quarantine_facts,
    quarantined_chunks,
    stop_reason,
)
from diloco.observe.events import METRICS_LOG, TENSORBOARD_DIR
from diloco.tokenizer import load_tokenizer


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


def ddp_wire_bytes_per_token(params: int, workers: int, batch_size: int, tokens_per_row: int) -> float:
    """What DDP moves per trained token with the same model, batch and workers: a ring all-reduce
    of fp32 gradients every step, in which each of N ranks sends (and receives) 2(N−1)/N × 4 bytes
    per parameter. Each byte is counted once, as diloco's wire bytes are (sent by one side,
    received by the other)."""
    if workers < 2:
        return 0.0
    per_step = workers * (2 * (workers - 1) / workers) * 4 * params
    return per_step / (workers * batch_size * tokens_per_row)


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
    """Mean over learners of the time from the job's start to their first inner step in this job
    (the first life that stepped after `started_at`: a resumed run's logs also hold the lives of
    the jobs before it)."""
    firsts = []
    for log in sorted(log_dir.glob("learner-*.log")):
        lives = read_startups(log.read_text(errors="replace"))
        ours = [life for life in lives if life.first_step_at >= started_at]
        if ours:
            firsts.append(ours[0].first_step_at - started_at)
    return sum(firsts) / len(firsts) if firsts else 0.0


def run_evals(workdir: Path) -> list[dict[str, Any]] | None:
    """Every evaluation the ledger holds, oldest first (None: no ledger). The coordinator's final
    status can be read before the evaluator reports its last evaluation (the final model's)."""
    from diloco.coordinator.ledger import ledger_path
    from diloco.coordinator.ledger.evals import eval_records
    from diloco.coordinator.report import read_only

    if not ledger_path(workdir).exists():
        return None
    with read_only(workdir) as db:
        db.row_factory = sqlite3.Row
        return eval_records(db.execute("SELECT * FROM evals ORDER BY id").fetchall())


def time_shares(w: dict[str, Any]) -> dict[str, float]:
    """A learner's time (its last life) in shares of one whole: inner steps (utilization), data
    stall, syncer waits and token-budget waits. The whole is its wall time, or the sum of the
    parts where that is larger (the final flush's syncer wait comes after its wall clock stopped):
    the shares never add to more than 1."""
    parts = {
        "utilization": w.get("busy_seconds", 0.0),
        "data_stall_share": w.get("data_stall_seconds", 0.0),
        "sync_wait_share": w.get("sync_wait_seconds", 0.0),
        "budget_wait_share": w.get("budget_wait_seconds", 0.0),
    }
    whole = max(float(w.get("wall_seconds") or 0.0), sum(parts.values()))
    return {k: v / whole if whole > 0 else 0.0 for k, v in parts.items()}


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


# Fewer outer steps than this and DiLoCo ends measurably above DDP at equal tokens: see
# few_outer_steps_warning.
MIN_OUTER_STEPS = 12


def few_outer_steps_warning(cfg: RunConfig, learners: int) -> str | None:
    """Why a token budget this small for this H leaves DiLoCo short of DDP, or None.

    Each fragment takes one outer step per H inner steps; over a short budget that is a handful.
    Measured at equal tokens (README, "Training quality"): the 2-layer GPT grid's cells with 12
    outer steps ended 1% above DDP, those with 3-6 ended 4-6% above; the tiny Llama's 5 ended 2-3%
    above. The first outer steps are also the warm-up's (sync.outer_warmup_rounds).
    """
    budget, h = cfg.train.max_tokens, cfg.train.inner_steps
    if budget <= 0 or learners <= 0 or h <= 0:
        return None
    # A preprocess's data is counted in samples, one per row; packed text in tokens per row.
    unit, per_row = ("samples", 1) if cfg.data.preprocess else ("tokens", cfg.model.seq_len + 1)
    steps = budget // (learners * cfg.train.batch_size * per_row)
    if steps // h >= MIN_OUTER_STEPS:
        return None
    said = (
        f"{budget:,} {unit} over {learners} learners at batch {cfg.train.batch_size} are {steps} inner steps "
        f"each: {steps // h} outer step(s) at H = {h}. With fewer than {MIN_OUTER_STEPS}, DiLoCo has ended "
        f"2-6% above DDP at equal tokens; "
    )
    # An H the config check takes: a multiple of the fragments P, above the overlap τ.
    p = cfg.sync.fragments
    smallest = p * (cfg.sync.overlap_steps // p + 1)
    better = (steps // MIN_OUTER_STEPS) // p * p
    if better < smallest:
        return (
            said
            + f"even H = {smallest} gives only {steps // smallest}: a larger budget (--tokens) gives more."
        )
    return said + f"H = {better} (--set train.inner_steps={better}) gives {steps // better}."


def mean_of(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def summarize(
    d: dict[str, Any],
    cfg: RunConfig,
    *,
    name: str,
    workdir: Path,
    learners: int,
    data_workers: int,
    slow_learner: float,
    train_seconds: float,
    total_seconds: float,
    minutes: float | None = None,
    earlier: RecordedRun | None = None,
) -> dict[str, Any]:
    """The run's figures from the coordinator's last status, and its final model evaluated.
    `minutes`: the job's time limit (--minutes; 0: none; None: not known), to tell it from an
    operator's finish in `stopped`."""
    summary: dict[str, Any] = {
        "name": name,
        "workdir": str(workdir),
        "learners": learners,
        "data_workers": data_workers,
        "tokens_trained": d.get("tokens_trained", 0),
        "tokens_merged": d.get("tokens_merged", 0),
        "rounds": d.get("rounds", 0),
        "fragment_versions": d.get("fragment_versions") or [],
        "chunks": d.get("chunks_total", 0),
        "chunks_done": d.get("chunks_done", 0),
        "chunks_quarantined": d.get("chunks_quarantined", 0),
        "shards": d.get("shards_total", 0),
        "tokens_prepared": d.get("tokens_prepared", 0),
        "first_loss": d.get("first_loss"),
        "train_metrics": d.get("train_metrics") or {},
        # The global model's held-out loss while the run trained (the evaluator's reports, every
        # one: the ledger's, read after the run, holds the final model's that the status may not).
        "evals": run_evals(workdir) or d.get("evals") or [],
        # The run's curves on disk (diloco.observe.events): `tensorboard --logdir`, or plot the jsonl.
        "metrics_log": str(workdir / METRICS_LOG),
        "tensorboard_dir": str(workdir / TENSORBOARD_DIR) if (workdir / TENSORBOARD_DIR).exists() else None,
        "wire_bytes": d.get("wire_bytes_in", 0) + d.get("wire_bytes_out", 0),
        "wire_bytes_by_rpc": d.get("wire_by_rpc", {}),
        "wire_bytes_by_role": d.get("wire_by_role", {}),
        "wall_seconds": round(train_seconds, 2),
        "total_seconds": round(total_seconds, 2),
        "pushes_refused": d.get("pushes_refused", 0),
        "pushes_center_clipped": d.get("pushes_center_clipped", 0),
        "record_stats": d.get("record_stats", {}),
        "transfers": d.get("transfers", {}),
    }
    # A resumed run (`earlier`: what its ledger held when this job started): the counts above are
    # the run's, and every rate below is this job's own counts over this job's time (the wire
    # bytes, too, are this job's coordinator's).
    before = earlier or RecordedRun("", 0, 0, 0)
    summary["resumed_from"] = (
        {"tokens_trained": before.tokens_trained, "tokens_merged": before.tokens_merged}
        if before.tokens_trained or before.tokens_merged
        else None
    )
    job_trained = summary["job_tokens_trained"] = max(0, summary["tokens_trained"] - before.tokens_trained)
    job_merged = summary["job_tokens_merged"] = max(0, summary["tokens_merged"] - before.tokens_merged)
    summary["job_tokens_pushed"] = max(0, d.get("tokens_pushed", 0) - before.tokens_pushed)
    trained = max(1, job_trained)
    summary["wire_bytes"] = max(
        0, summary["wire_bytes"] - before.wire_bytes
    )  # every life's, less earlier jobs'
    summary["wire_bytes_per_token"] = summary["wire_bytes"] / trained
    # Each learner's one-time join (the initial parameters offered, its first full pull)
    # amortizes over a long run; what goes on per token after it is the steady-state cost.
    by_rpc = summary["wire_bytes_by_rpc"]
    joining = sum(by_rpc.get(k, {}).get("received", 0) + by_rpc.get(k, {}).get("sent", 0)
                  for k in ("init", "pull_join")) - before.wire_join_bytes  # fmt: skip
    summary["steady_wire_bytes_per_token"] = (summary["wire_bytes"] - joining) / trained
    tokenizer = load_tokenizer(cfg.data.tokenizer)  # loaded once: the evaluation samples with it
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    # torch and the model are imported here, after the run: the supervisor's start-up is then
    # light, and its CPU goes to the children it starts.
    from diloco.local.evaluation import evaluate_final_or_say_why, param_count

    params = summary["params"] = trained_param_count(workdir) or param_count(cfg, vocab)
    summary["ddp_wire_bytes_per_token"] = (
        ddp_wire_bytes_per_token(
            params, learners, cfg.train.batch_size, 1 if cfg.data.preprocess else cfg.model.seq_len + 1
        )
        if params
        else 0.0
    )
    # What the ledger counted exactly once: tokens of packed rows, or samples of a preprocess.
    summary["unit"] = cfg.data.unit
    summary["trained_tokens_per_s"] = job_trained / max(train_seconds, 1e-9)
    summary["merged_tokens_per_s"] = job_merged / max(train_seconds, 1e-9)
    timed = [w for w in d.get("workers", []) if w["role"] == "compute" and w.get("wall_seconds")]
    # Each share over the same whole (time_shares): utilization and the waits add up to 1 at most.
    shares = {w["worker_id"]: time_shares(w) for w in timed}
    by_learner = {wid: sh["utilization"] for wid, sh in shares.items()}
    summary["utilization_per_learner"] = [round(u, 4) for u in by_learner.values()]
    summary["utilization_by_learner"] = {wid: round(u, 4) for wid, u in by_learner.items()}
    slow = learner_id(learners - 1) if slow_learner > 1.0 else None
    summary["slow_learner"] = slow
    others = [u for wid, u in summary["utilization_by_learner"].items() if wid != slow]
    summary["utilization_min_others"] = min(others) if others else 0.0
    summary["utilization"] = mean_of(list(by_learner.values()))
    summary["data_stall_share"] = mean_of([sh["data_stall_share"] for sh in shares.values()])
    summary.update(
        data_plane_metrics(
            {**d, "tokens_prepared": d.get("tokens_prepared", 0) - before.tokens_prepared}, train_seconds
        )
    )
    summary["sync_wait_share"] = mean_of([sh["sync_wait_share"] for sh in shares.values()])
    # The token budget's end game: waits for the last allowances that more steps followed.
    summary["budget_wait_share"] = mean_of([sh["budget_wait_share"] for sh in shares.values()])
    # One fragment's pull as the learners timed it, arrival to arrival: the coordinator's own
    # clock (transfers.pull_seconds_mean) stops with most of the bytes still in its buffers.
    pulled = sum(w.get("pulled_fragments", 0) for w in timed)
    if pulled:
        summary["transfers"]["learner_pull_seconds_mean"] = (
            sum(w.get("pull_seconds", 0.0) for w in timed) / pulled
        )
    # Goodput needs every learner-second of this job; a resumed run's busy seconds hold its
    # earlier jobs' too: not measured then (None).
    summary["goodput"] = (
        goodput(
            d.get("learner_kept_busy_seconds", 0.0),
            job_merged,
            summary["job_tokens_pushed"],
            learners,
            train_seconds,
        )
        if summary["resumed_from"] is None
        else None
    )
    # Each learner's tokens over its own training time (first inner step to its last), summed:
    # what a peer's loop timed from its start barrier measures, without the job's start-up.
    summary["learner_tokens_per_s"] = round(
        sum(w.get("tokens_trained", 0) / w["wall_seconds"] for w in timed), 1
    )
    # ...and with the token budget's end game left out (budget_wait_share): the loop's own speed,
    # where the other figure also holds waits for the budget's last allowances.
    summary["learner_tokens_per_s_outside_budget_waits"] = round(
        sum(
            w.get("tokens_trained", 0) / max(1e-9, w["wall_seconds"] - w.get("budget_wait_seconds", 0.0))
            for w in timed
        ),
        1,
    )
    # ...and per CPU-second its processes used over that time (a group's ranks each do rank 0's
    # arithmetic, so rank 0's CPU stands for each): a speed that does not depend on how many cores
    # the job's other roles took from the learners, as they do on one small machine.
    cpu = sum(w.get("cpu_seconds", 0.0) * int(w.get("ranks") or 1) for w in timed)
    summary["learner_tokens_per_cpu_s"] = (
        round(sum(w.get("tokens_trained", 0) for w in timed) / cpu, 1) if cpu > 0 else None
    )
    # Each learner's own speed in its inner steps (its last life), its ranks and its MFU (None
    # where the device's peak is not known, e.g. a CPU).
    summary["learners_detail"] = {
        w["worker_id"]: {
            "tokens_per_s": round(w.get("tokens_trained", 0) / w["busy_seconds"], 1)
            if w.get("busy_seconds")
            else None,
            "ranks": int(w.get("ranks") or 1),
            "device": w.get("device", ""),
            "mfu": w.get("mfu"),
            # How its deltas stood against the others' (coordinator/pusher_watch.py).
            **{k: w.get(k) for k in WATCH_FIGURES},
        }
        for w in timed
    }
    summary["suspect_learners"] = d.get("suspect_learners") or {}
    summary.update(evaluate_final_or_say_why(d, cfg, workdir, tokenizer))
    summary.update(quarantine_facts(quarantined_chunks(workdir, d.get("quarantined") or [])))
    # This job's learners only: a resumed run's ledger also holds those of the jobs before it.
    ours = {learner_id(i) for i in range(learners)}
    ends = learner_ends(
        workdir,
        [w["worker_id"] for w in d.get("workers", []) if w["role"] == "compute" and w["worker_id"] in ours],
    )
    stop = stop_reason(
        tokens_merged=summary["tokens_merged"], budget=cfg.train.max_tokens, wall_seconds=train_seconds,
        minutes=minutes, learner_ends=ends, finish_reason=finish_reason(workdir),
    )  # fmt: skip
    summary["stopped"], summary["stopped_because"] = stop.code, stop.because
    summary["config"] = cfg.to_dict()
    return summary


def job_report(
    d: dict[str, Any], summary: dict[str, Any], *, workdir: Path, learners: int, train_seconds: float,
    started_at: float,
) -> dict[str, Any]:  # fmt: skip
    """What the ledger and the logs say after the run: the audit, merge gaps, rounds, start-up."""
    from diloco.coordinator.audit import audit  # reads checkpoints: torch, imported after the run

    report = audit(workdir)
    # The job's own start-up (every learner's first life, up to its first step) is paid once
    # per job, not per failure: goodput after it is what a long run converges to.
    job_startup = job_startup_seconds(workdir / "logs", started_at)
    return {
        "audit_ok": report.ok,
        "audit_violations": report.violations,
        "longest_merge_gap_s": longest_merge_gap(workdir),
        "rounds_by_pushes": rounds_by_pushes(workdir),
        "job_startup_seconds": round(job_startup, 2),
        "goodput_after_start": goodput(
            d.get("learner_kept_busy_seconds", 0.0),
            summary["job_tokens_merged"],
            summary["job_tokens_pushed"],
            learners,
            max(1e-9, train_seconds - job_startup),
        )
        if summary.get("resumed_from") is None
        else None,
    }
