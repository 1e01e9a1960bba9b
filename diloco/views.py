"""What goes to the terminal: a local run's live progress and final result, and `diloco status`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table


def progress_line(d: dict[str, Any], started: float) -> str:
    """One line of progress (for a terminal that is not interactive)."""
    loss = d.get("last_loss")
    return (
        f"[{time.monotonic() - started:6.0f}s] chunks {d.get('chunks_done', 0)}/{d.get('chunks_total', 0)} "
        f"prepared {d.get('tokens_prepared', 0):,} trained {d.get('tokens_trained', 0):,} "
        f"merged {d.get('tokens_merged', 0):,} rounds {d.get('rounds', 0)} "
        f"loss {f'{loss:.4f}' if loss else '-'}{metrics_text(d.get('train_metrics'))} "
        f"held-out {eval_text(d)}"
        + (f" SAVING MERGES {saving_text(d['publish_failing'])}" if d.get("publish_failing") else "")
    )


def metrics_text(metrics: dict[str, float] | None) -> str:
    """The model's own metrics, e.g. " accuracy 0.9130" ("" when it returns none)."""
    return "".join(f" {name} {value:.4f}" for name, value in sorted((metrics or {}).items()))


def eval_text(d: dict[str, Any]) -> str:
    """The latest held-out evaluation of the global model (the evaluator's), e.g. "2.4031
    accuracy 0.9130 (versions [4, 4], 1,204,224 merged, 3 evals)"; "-" before the first."""
    evals = d.get("evals") or []
    if not evals:
        return "-"
    e = evals[-1]
    return (
        f"{e['loss']:.4f}{metrics_text(e.get('metrics'))} (versions {e['fragment_versions']}, "
        f"{e['tokens_merged']:,} merged, {len(evals)} eval{'s' if len(evals) != 1 else ''})"
    )


def progress_table(d: dict[str, Any], started: float, name: str, minutes: float) -> Table:
    """The live view of a local run."""
    table = Table(title=f"diloco run {name}", show_header=False, min_width=60)
    elapsed = time.monotonic() - started
    budget = f" / {minutes:.1f} min" if minutes > 0 else ""
    table.add_row("elapsed", f"{elapsed / 60:.1f} min{budget}")
    table.add_row(
        "chunks",
        f"{d.get('chunks_done', 0)} / {d.get('chunks_total', 0)} "
        f"({d.get('chunks_quarantined', 0)} quarantined)",
    )
    unit = d.get("unit", "tokens")
    table.add_row(f"{unit} prepared", f"{d.get('tokens_prepared', 0):,}")
    table.add_row(f"{unit} trained", f"{d.get('tokens_trained', 0):,}")
    table.add_row(f"{unit} merged", f"{d.get('tokens_merged', 0):,}")
    table.add_row(
        "rounds", f"{d.get('rounds', 0)}  versions {d.get('fragment_versions', [])}" + last_merge_text(d)
    )
    if failing := d.get("publish_failing"):
        table.add_row("[red]saving merges[/]", saving_text(failing))
    add_suspects(table, d.get("suspect_learners"), d.get("suspects_refused", False))
    loss = d.get("last_loss")
    table.add_row("loss", f"{loss:.4f}" if loss else "-")
    if d.get("train_metrics"):
        table.add_row("train metrics", metrics_text(d["train_metrics"]).strip())
    table.add_row("held-out eval", eval_text(d))
    learners = [w for w in d.get("workers", []) if w["role"] == "compute"]
    table.add_row("learners alive", f"{sum(w['alive'] for w in learners)} / {len(learners)}")
    return table


def add_suspects(table: Table, suspects: dict[str, str] | None, refused: bool = False) -> None:
    """Learners whose pushes look hostile or broken (coordinator/pusher_watch.py): a red row each,
    their ids and reasons shown as text, never as markup; `refused`: their pushes are refused
    meanwhile (sync.refuse_suspects)."""
    then = " (its pushes refused meanwhile)" if refused else ""
    for worker, reason in (suspects or {}).items():
        table.add_row(f"[red]suspect {escape(worker)}[/]", escape(reason) + then)


def last_merge_text(d: dict[str, Any]) -> str:
    """How long ago the last merge was saved: what tells a run that merges from one that is stuck."""
    seconds = d.get("last_merge_s")
    return "" if seconds is None else f", last merge {seconds:.0f} s ago"


def saving_text(failing: dict[str, Any]) -> str:
    """Merges the coordinator cannot save (a full disk): since when, and the store's error."""
    return f"FAILING for {failing['seconds']:.0f} s: {failing['error']}"


def than_ddp(ddp: float, ours: float) -> str:
    """What DDP sends against ours, said the right way round: "1,633× more", or "2.5× less" when
    ours is the larger (a run whose pushes carried few tokens: a short one, or int4 at H = 1)."""
    if ddp >= ours:
        return f"{ddp / ours:,.0f}× more"
    return f"{ours / ddp:,.1f}× less"


# The quarantine reason the table shows: the error's first line, cut short (summary.json has more).
REASON_SHOWN_CHARS = 120


def eval_loss_text(loss: float | None, per: str, eval_quarantined: int) -> str:
    """The final held-out loss, or why there is none: held-out chunks lost to quarantine are not
    the same as a dataset without a held-out split."""
    lost = f"{eval_quarantined} held-out chunk{'s' if eval_quarantined != 1 else ''} quarantined"
    if loss is not None:
        return f"{loss:.4f}{per}" + (f" ({lost})" if eval_quarantined else "")
    return f"- ({lost})" if eval_quarantined else "- (no held-out data)"


def quarantine_text(count: int, reason: str | None) -> str:
    """How many chunks failed too often to be retried, and the first one's recorded error."""
    if not reason:
        return str(count)
    line = reason.strip().splitlines()[0] if reason.strip() else ""
    if len(line) > REASON_SHOWN_CHARS:
        line = line[: REASON_SHOWN_CHARS - 1] + "…"
    return f"{count} (first: {line})" if line else str(count)


# A learner busy less than this share of the busiest one's time is named under the mean.
UNEVEN_UTILIZATION = 0.5


def lowest_learner_text(by_learner: dict[str, float]) -> str:
    """The least busy learner, when it kept under half as busy as the busiest: a mean over
    learners hides one that sat idle (starved of data, stuck in restarts, or on a slow device)."""
    if len(by_learner) < 2:
        return ""
    wid, lowest = min(by_learner.items(), key=lambda item: item[1])
    busiest = max(by_learner.values())
    if lowest >= UNEVEN_UTILIZATION * busiest:
        return ""
    return f"{wid} {lowest:.1%} (busiest {busiest:.1%}; summary.json: utilization_by_learner)"


def print_summary(console: Console, summary: dict[str, Any], path: Path) -> None:
    table = Table(title="result", show_header=False)
    unit = summary.get("unit", "tokens")  # or samples, for a preprocess's data
    ev, base = summary.get("eval_loss"), summary.get("baseline_loss")
    per = " nats/token" if unit == "tokens" else ""
    if failed := summary.get("final_eval_error"):
        table.add_row("eval loss", f"- (the final evaluation failed: {failed[:REASON_SHOWN_CHARS]})")
    else:
        table.add_row("eval loss", eval_loss_text(ev, per, summary.get("eval_chunks_quarantined", 0)))
    for name, value in (summary.get("eval_metrics") or {}).items():
        table.add_row(f"eval {name}", f"{value:.4f}")
    if base is not None:
        table.add_row("unigram baseline", f"{base:.4f} nats/token")
    first = summary.get("first_loss")
    table.add_row("first-step loss", f"{first:.4f}" if first else "-")
    table.add_row(f"{unit} trained / merged", f"{summary['tokens_trained']:,} / {summary['tokens_merged']:,}")
    if before := summary.get("resumed_from"):
        table.add_row(
            "  resumed",
            f"{before['tokens_merged']:,} merged before this job; the rates below are this job's",
        )
    table.add_row("rounds", str(summary["rounds"]))
    table.add_row("chunks / shards", f"{summary['chunks']} / {summary['shards']}")
    if quarantined := summary.get("chunks_quarantined", 0):
        table.add_row("chunks quarantined", quarantine_text(quarantined, summary.get("quarantine_reason")))
    ddp = summary.get("ddp_wire_bytes_per_token") or 0.0
    wire = summary["wire_bytes_per_token"]
    ratio = f" (DDP: {ddp:,.0f}, {than_ddp(ddp, wire)})" if ddp and wire else ""
    table.add_row(f"wire bytes per {unit[:-1]}", f"{wire:.1f}{ratio}")
    steady = summary.get("steady_wire_bytes_per_token") or 0.0
    if steady:
        more = f" (DDP: {than_ddp(ddp, steady)})" if ddp else ""
        table.add_row("  after each learner's join", f"{steady:.1f}{more}")
    waited = [
        f"{summary[key]:.1%} {why}"
        for key, why in (
            ("sync_wait_share", "on the syncer"),
            ("budget_wait_share", "at the token budget's end"),
        )
        if summary.get(key, 0.0) >= 0.001
    ]
    # Shares of one whole (summary.time_shares: each learner's last life), so they add to 100% at most.
    table.add_row(
        "learner utilization",
        f"{summary['utilization']:.1%} in inner steps"
        + (f"; of the rest, waited {', '.join(waited)}" if waited else "")
        + " (each learner's last life)",
    )
    if lowest := lowest_learner_text(summary.get("utilization_by_learner") or {}):
        table.add_row("  lowest learner", lowest)
    table.add_row(
        "data",
        f"{summary.get('data_tokens_per_s', 0.0):,.0f} {unit} prepared per second of the run's wall time, "
        f"learners waited {summary.get('data_stall_share', 0.0):.1%} of the time",
    )
    table.add_row("wall time", f"{summary['wall_seconds']:.0f} s")
    if summary.get("stopped_because"):
        table.add_row("stopped", summary["stopped_because"])
    if summary.get("kills"):
        table.add_row("chaos kills", ", ".join(f"{k} {v}" for k, v in sorted(summary["kills"].items())))
    table.add_row(
        "audit", "ok" if summary.get("audit_ok") else f"VIOLATIONS: {summary.get('audit_violations')}"
    )
    add_suspects(table, summary.get("suspect_learners"))
    console.print(table)
    if summary.get("sample"):
        console.print("[bold]sample[/] (the trained model continues the prompt):")
        console.print(summary["sample"], markup=False, highlight=False)
    console.print(f"summary: {path}", soft_wrap=True)  # a path is copied whole: never wrapped


STATUS_COLUMNS = ("worker", "role", "state", "device", "steps", "tokens", "tokens/s", "loss", "utilization",
                  "data stall", "last push", "lag", "metrics")  # fmt: skip


def status_columns(unit: str) -> tuple[str, ...]:
    """The workers table's columns, counting the run's unit (tokens, or a preprocess's samples)."""
    return tuple({"tokens": unit, "tokens/s": f"{unit}/s"}.get(c, c) for c in STATUS_COLUMNS)


def status_tables(detail: dict[str, Any]) -> Group:
    """`diloco status`: the run (data, training, the held-out eval) and a table of its workers."""
    d = detail
    run = Table(title=f"run {d['run_state']} · coordinator epoch {d['coordinator_epoch']}", show_header=False)
    run.add_row(
        "chunks", f"{d['chunks_done']}/{d['chunks_total']} done, {d['chunks_quarantined']} quarantined"
    )
    run.add_row("shards", shards_text(d))
    run.add_row(
        d.get("unit", "tokens"),
        f"prepared {d['tokens_prepared']:,}, trained {d['tokens_trained']:,}, merged {d['tokens_merged']:,}",
    )
    run.add_row("rounds", f"{d['rounds']}, fragment versions {d['fragment_versions']}" + last_merge_text(d))
    if failing := d.get("publish_failing"):
        run.add_row("saving merges", saving_text(failing))
    run.add_row("pushes", pushes_text(d))
    add_suspects(run, d.get("suspect_learners"), d.get("suspects_refused", False))
    loss = d.get("last_loss")
    run.add_row("last loss", (f"{loss:.4f}" if loss else "-") + metrics_text(d.get("train_metrics")))
    run.add_row("held-out eval", eval_text(d))
    run.add_row("records", records_line(d.get("record_stats", {})).removeprefix("records "))
    shown, total = len(d["workers"]), d.get("workers_total", len(d["workers"]))
    workers = Table(title="workers" if shown == total else f"workers ({shown} of {total}: the live first)")
    for column in status_columns(d.get("unit", "tokens")):
        workers.add_column(
            column, justify="left" if column in ("worker", "role", "state", "metrics") else "right"
        )
    for w in d["workers"]:
        workers.add_row(*worker_cells(w))
    workers.caption = f"{d.get('unit', 'tokens')}/s: per second of work (a learner's in inner steps, a data worker's on chunks)"
    return Group(run, workers)


def pushes_text(d: dict[str, Any]) -> str:
    """The deltas pushed: taken, refused, and of those taken the ones pulled toward their
    fragment's mean step (sync.center_clip) or taken for their rows only."""
    text = f"{d.get('pushes_received', 0):,} taken, {d.get('pushes_refused', 0):,} refused"
    if clipped := d.get("pushes_center_clipped"):
        text += f", {clipped:,} clipped toward their fragment's mean step"
    if rows_only := d.get("pushes_rows_only"):
        text += f", {rows_only:,} for their rows only"
    return text


def shards_text(d: dict[str, Any]) -> str:
    """The shards made, of them the train shards learners trained rows of, and those every row
    of which merged (a shard is consumed only then: a run that stops part-way through its data,
    or mixes rows from many shards, may consume few or none while it trains on all of them)."""
    started = d.get("shards_started")
    trained = "" if started is None else f"{started} train with rows trained, "
    return f"{d['shards_total']} ({trained}{d['shards_consumed']} with every row merged)"


def worker_cells(w: dict[str, Any]) -> list[str]:
    """One worker in `diloco status`: a learner's progress and data stall, a data worker's tokens/s."""
    state = "alive" if w["alive"] else w["state"]
    if w["role"] == "data":
        return [w["worker_id"], "data", state, "", "", f"{w.get('tokens_prepared', 0):,}",
                f"{w.get('tokens_per_s', 0.0):,.0f}", "", "", "", "", "", ""]  # fmt: skip
    if w["role"] != "compute":
        return [w["worker_id"], w["role"], state, *[""] * 10]
    wall = w.get("wall_seconds") or 0.0
    age = w.get("last_push_age_s")
    return [
        w["worker_id"], "learner", state, device_text(w), f"{w.get('inner_steps', 0):,}",
        f"{w.get('tokens_trained', 0):,}", speed_text(w),
        f"{w['last_loss']:.4f}" if w.get("last_loss") else "-",
        f"{w.get('busy_seconds', 0.0) / wall:.1%}" if wall else "-",
        f"{w.get('data_stall_seconds', 0.0) / wall:.1%}" if wall else "-",
        f"{age:.1f} s ago" if age is not None else "-",
        str(w["version_lag"]) if w.get("version_lag") is not None else "-",
        metrics_text(w.get("train_metrics")).strip(),
    ]  # fmt: skip


def device_text(w: dict[str, Any]) -> str:
    """Where a learner computes: "cuda:0 ×8" for a torchrun group of 8 ranks."""
    ranks = int(w.get("ranks") or 1)
    return w.get("device", "") + (f" ×{ranks}" if ranks > 1 else "")


def speed_text(w: dict[str, Any]) -> str:
    """A learner's tokens per second in its inner steps, with its MFU where its device's peak is known."""
    busy = w.get("busy_seconds") or 0.0
    if not busy:
        return "-"
    mfu = w.get("mfu")
    return f"{w.get('tokens_trained', 0) / busy:,.0f}" + (f" ({mfu:.0%} MFU)" if mfu else "")


def records_line(stats: dict) -> str:
    """The bad-input summary in `diloco status`: records read, and what was skipped or repaired, by reason."""
    bad = ", ".join(
        f"{k.removeprefix('skipped_')} {v:,}" for k, v in sorted(stats.items()) if k != "records" and v
    )
    return f"records {stats.get('records', 0):,}" + (f"; bad input: {bad}" if bad else "; no bad input")
