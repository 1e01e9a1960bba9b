"""What `diloco run` reports beside its own: DDP's bytes, the syncer's longest pause, data speeds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from diloco.client import CoordinatorClient
from diloco.compute.startup import breakdown, describe, read_startups
from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger
from diloco.coordinator.report import longest_merge_gap, trained_param_count
from diloco.coordinator.server import start_coordinator
from diloco.data.shard import write_shard
from diloco.data.worker import DataWorker
from diloco.local.summary import (
    cold_start_warning,
    data_plane_metrics,
    ddp_wire_bytes_per_token,
    few_outer_steps_warning,
    goodput,
    job_startup_seconds,
)
from diloco.tokenizer import load_tokenizer
from diloco.v1 import coordinator_pb2 as pb
from diloco.views import (
    STATUS_COLUMNS,
    last_merge_text,
    lowest_learner_text,
    print_summary,
    pushes_text,
    status_columns,
    status_tables,
    than_ddp,
    worker_cells,
)
from tests.support import commit_merge


def test_ddp_bytes_per_token_is_the_ring_all_reduce() -> None:
    # 4 ranks, 1000 params: each rank sends 2·3/4·4 B per parameter per step = 6000 B; all ranks
    # 24000 B per step, for 4·16·129 tokens.
    assert ddp_wire_bytes_per_token(1000, 4, 16, 129) == pytest.approx(24000 / (4 * 16 * 129))
    assert ddp_wire_bytes_per_token(1000, 1, 16, 129) == 0.0  # one rank all-reduces nothing


def test_longest_merge_gap_reads_the_rounds(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    now = [100.0]
    ledger = Ledger(str(tmp_path / "state" / "ledger.sqlite"), clock=lambda: now[0])
    for t, version in ((100.0, 1), (103.0, 2), (110.5, 3), (111.0, 4)):
        now[0] = t
        commit_merge(ledger, 0, version, [], 0, 0, None, "test")
    ledger.close()
    assert longest_merge_gap(tmp_path) == 7.5


def test_the_parameter_count_is_the_offered_shapes_less_running_statistics(tmp_path: Path) -> None:
    """Read from the ledger, without building the model (on the meta device its init imported
    torch's compiler, seconds at the end of every run); None before a learner initialized it."""
    assert trained_param_count(tmp_path) is None  # no ledger yet
    (tmp_path / "state").mkdir()
    ledger = Ledger(str(tmp_path / "state" / "ledger.sqlite"))
    assert trained_param_count(tmp_path) is None
    specs = [
        {"name": "w", "dtype": "float32", "shape": [3, 4], "averaged": False},
        {"name": "b", "dtype": "float32", "shape": [4]},  # written before the mark existed
        {"name": "bn.running_var", "dtype": "float32", "shape": [4], "averaged": True},
    ]
    ledger.set_meta(param_specs=json.dumps(specs))
    ledger.close()
    assert trained_param_count(tmp_path) == 16


def test_data_plane_metrics_from_status_detail() -> None:
    detail = {
        "tokens_prepared": 300_000,
        "workers": [
            {"worker_id": "data-0", "role": "data", "tokens_per_s": 50_000.0},
            {"worker_id": "data-1", "role": "data", "tokens_per_s": 40_000.0},
            {"worker_id": "learner-0", "role": "compute", "wall_seconds": 20.0, "data_stall_seconds": 1.0},
            {"worker_id": "learner-1", "role": "compute", "wall_seconds": 0.0},  # never reported
            {"worker_id": "observer-x", "role": "observer"},
        ],
    }
    assert data_plane_metrics(detail, 30.0) == {
        "data_tokens_per_s": 10_000.0,
        "data_tokens_per_s_by_worker": {"data-0": 50_000.0, "data-1": 40_000.0},
        "data_stall_by_learner": {"learner-0": 0.05},
    }
    assert data_plane_metrics({}, 0.0)["data_tokens_per_s"] == 0.0


def test_status_shows_data_stall_and_data_worker_speed() -> None:
    learner = {"worker_id": "learner-0", "role": "compute", "alive": True, "state": "active",
               "inner_steps": 10, "tokens_trained": 1290, "wall_seconds": 8.0, "data_stall_seconds": 2.0}  # fmt: skip
    data = {"worker_id": "data-0", "role": "data", "alive": False, "state": "left",
            "tokens_prepared": 12345, "tokens_per_s": 61234.4}  # fmt: skip
    cells = dict(zip(STATUS_COLUMNS, worker_cells(learner), strict=True))
    assert (cells["steps"], cells["tokens"], cells["data stall"]) == ("10", "1,290", "25.0%")
    assert cells["tokens/s"] == "-"  # no time in inner steps reported yet
    cells = dict(zip(STATUS_COLUMNS, worker_cells(data), strict=True))
    assert (cells["state"], cells["tokens"], cells["tokens/s"]) == ("left", "12,345", "61,234")
    group = {**learner, "device": "cuda:0", "ranks": 8, "busy_seconds": 2.0, "mfu": 0.41}
    cells = dict(zip(STATUS_COLUMNS, worker_cells(group), strict=True))
    assert (cells["device"], cells["tokens/s"]) == ("cuda:0 ×8", "645 (41% MFU)")


@pytest.mark.timeout(90)
def test_status_counts_each_data_workers_tokens_once(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 3000)
    cfg = RunConfig().with_overrides({
        "data.dataset": str(corpus), "data.chunk_bytes": 32768, "data.eval_fraction": 0.0,
        "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32, "model.kwargs.n_head": 2,
    })  # fmt: skip
    running = start_coordinator(cfg, str(tmp_path / "coord"))
    address = f"127.0.0.1:{running.port}"
    try:
        # One chunk by hand, its completion sent twice (the retry after a lost reply).
        hand = CoordinatorClient(address, pb.ROLE_DATA, worker_id="data-hand")
        hand.join()
        lease = hand.call("LeaseChunk", pb.LeaseChunkRequest())
        rows = np.zeros((10, cfg.model.seq_len + 1), np.uint16)
        info = write_shard(lease.shard_uri, rows, tokenizer_id=load_tokenizer("byte").id, vocab_size=257,
                           chunk_index=lease.chunk_id - 1)  # fmt: skip
        request = pb.CompleteChunkRequest(
            chunk_id=lease.chunk_id, completion_id="c-1", shard_uri=info.uri, rows=info.rows,
            tokens=info.tokens, checksum=info.checksum, shard_bytes=info.nbytes, seconds=0.5,
        )  # fmt: skip
        assert [hand.call("CompleteChunk", request).accepted for _ in range(2)] == [True, True]
        hand.leave("done")
        hand.close()
        assert DataWorker(address, worker_id="data-0").run() == 0  # every other chunk
        detail = running.service.status_detail()
    finally:
        running.stop()
    data = {w["worker_id"]: w for w in detail["workers"] if w["role"] == "data"}
    assert data["data-hand"]["tokens_prepared"] == info.tokens
    assert data["data-hand"]["tokens_per_s"] == pytest.approx(info.tokens / 0.5, abs=0.1)
    assert data["data-0"]["tokens_prepared"] == detail["tokens_prepared"] - info.tokens > 0
    assert data["data-0"]["tokens_per_s"] > 0 and data["data-0"]["prepare_seconds"] > 0
    metrics = data_plane_metrics(detail, 2.0)
    assert metrics["data_tokens_per_s"] == pytest.approx(detail["tokens_prepared"] / 2.0, abs=0.1)
    assert set(metrics["data_tokens_per_s_by_worker"]) == {"data-hand", "data-0"}


def test_a_large_h_from_a_random_init_is_warned_about() -> None:
    cold = RunConfig().with_overrides({"train.inner_steps": 500})
    assert "model.init_from" in (cold_start_warning(cold) or "")
    assert cold_start_warning(cold.with_overrides({"model.init_from": "warm/model.safetensors"})) is None
    assert cold_start_warning(RunConfig()) is None  # the default H = 50


def test_a_budget_of_few_outer_steps_is_warned_about() -> None:
    # 2 learners x batch 16 x 129 tokens a step: 1,000,000 tokens are 242 steps each.
    short = RunConfig().with_overrides({"train.max_tokens": 1_000_000})
    warning = few_outer_steps_warning(short, learners=2) or ""
    assert "242 inner steps" in warning and "4 outer step(s) at H = 50" in warning
    assert "train.inner_steps=20" in warning  # 242 // 12
    assert few_outer_steps_warning(short.with_overrides({"train.inner_steps": 20}), learners=2) is None
    one = short.with_overrides({"train.inner_steps": 40})  # one learner: 484 steps, 12 outer steps
    assert few_outer_steps_warning(one, learners=1) is None and few_outer_steps_warning(one, learners=2)
    assert few_outer_steps_warning(RunConfig(), learners=2) is None  # no budget: until the data ends
    # A preprocess's budget is in samples, one per row: 1,500 over 3 learners at batch 16 are 31 steps.
    samples = RunConfig().with_overrides(
        {
            "train.max_tokens": 1500,
            "data.preprocess": "examples.digits.preprocess:pixels",
            "train.inner_steps": 10,
        }
    )
    warning = few_outer_steps_warning(samples, learners=3) or ""
    assert "1,500 samples over 3 learners at batch 16 are 31 inner steps each: 3 outer step(s)" in warning
    # The H it names is one the config check takes: a multiple of P = 2 above τ = 2.
    assert "even H = 4 gives only 7: a larger budget" in warning
    more = samples.with_overrides({"train.max_tokens": 6000, "train.inner_steps": 20})  # 125 steps each
    assert "H = 10 (--set train.inner_steps=10) gives 12." in (few_outer_steps_warning(more, 3) or "")
    assert few_outer_steps_warning(more.with_overrides({"train.inner_steps": 10}), 3) is None


def test_goodput_is_merged_work_over_learner_time() -> None:
    # 2 learners for 100 s; 150 s in inner steps that no kill lost; 90% of what they pushed merged.
    assert goodput(150.0, 900, 1000, learners=2, wall_s=100.0) == pytest.approx(0.675)
    assert goodput(0.0, 0, 0, learners=2, wall_s=100.0) == 0.0
    assert goodput(300.0, 2000, 1000, learners=2, wall_s=100.0) == 1.0  # never above 1


def test_start_up_breaks_down_from_spawn_to_first_step() -> None:
    marks = {"spawned": 10.0, "main": 10.2, "imports": 12.0, "join": 12.1, "pull": 12.6,
             "first_batch": 13.0, "first_step": 13.05}  # fmt: skip
    phases = breakdown(marks)
    assert phases == pytest.approx(
        {
            "process": 0.2,
            "imports": 1.8,
            "join": 0.1,
            "pull": 0.5,
            "first_batch": 0.4,
            "first_step": 0.05,
            "total": 3.05,
        }  # fmt: skip
    )
    assert describe(phases).startswith("start-up: process 0.20s, imports 1.80s")
    # Started by hand (no supervisor): the phases it can see.
    assert "process" not in breakdown({k: v for k, v in marks.items() if k != "spawned"})


def test_start_up_lines_read_back_with_their_time_and_the_job_start_up(tmp_path: Path) -> None:
    lines = [
        "2026-12-01 13:04:07,492 INFO learner[1] diloco.learner: start-up: process 0.16s, imports 9.92s, "
        "join 0.05s, model 5.27s, pull 0.45s, first batch 1.07s, first step 1.27s (total 18.19s)",
        "2026-12-01 13:04:09,000 INFO learner[1] diloco.learner: something else",
        "2026-12-01 13:05:00,000 INFO learner[2] diloco.learner: start-up: process 0.00s, imports 0.05s, "
        "join 0.04s, model 0.05s, pull 0.05s, first batch 0.03s, first step 1.13s (total 1.36s)",
    ]
    lives = read_startups("\n".join(lines))
    assert [life.phases["total"] for life in lives] == [18.19, 1.36]
    assert lives[0].phases["first_batch"] == 1.07 and lives[1].phases["imports"] == 0.05
    assert lives[1].first_step_at - lives[0].first_step_at == pytest.approx(52.508)
    (tmp_path / "learner-0.log").write_text("\n".join(lines))
    (tmp_path / "learner-1.log").write_text(lines[2])
    started = lives[0].first_step_at - 20.0
    # learner-0's first life took its first step 20 s in, learner-1's 72.5 s in
    assert job_startup_seconds(tmp_path, started) == pytest.approx((20.0 + 72.508) / 2)


def test_the_result_table_says_what_learners_waited_for() -> None:
    """Utilization short of 100% with no data stall: the table names the syncer's share and the
    token budget's end game (budget_wait_share), each only when there was any."""
    summary = {"tokens_trained": 1000, "tokens_merged": 1000, "rounds": 4, "chunks": 2, "shards": 2,
               "wire_bytes_per_token": 8.0, "utilization": 0.935, "wall_seconds": 30.0, "audit_ok": True}  # fmt: skip

    def row(extra: dict) -> str:
        console = Console(width=200, record=True)
        print_summary(console, {**summary, **extra}, Path("summary.json"))
        return next(line for line in console.export_text().splitlines() if "learner utilization" in line)

    assert "waited" not in row({"sync_wait_share": 0.0, "budget_wait_share": 0.0})
    line = row({"sync_wait_share": 0.0, "budget_wait_share": 0.052})
    assert "93.5% in inner steps; of the rest, waited 5.2% at the token budget's end" in line
    assert "syncer" not in line
    line = row({"sync_wait_share": 0.03, "budget_wait_share": 0.0})
    assert "93.5% in inner steps; of the rest, waited 3.0% on the syncer" in line and "budget" not in line
    both = row({"sync_wait_share": 0.03, "budget_wait_share": 0.052})
    assert "waited 3.0% on the syncer, 5.2% at the token budget's end (each learner's last life)" in both


def test_a_learner_much_less_busy_than_the_others_is_named_under_the_mean() -> None:
    assert lowest_learner_text({"learner-0": 0.9}) == ""
    assert lowest_learner_text({"learner-0": 0.9, "learner-1": 0.6}) == ""  # uneven, not idle
    line = lowest_learner_text({"learner-0": 0.9, "learner-1": 0.2, "learner-2": 0.85})
    assert line.startswith("learner-1 20.0% (busiest 90.0%")
    summary = {"tokens_trained": 1000, "tokens_merged": 1000, "rounds": 4, "chunks": 2, "shards": 2,
               "wire_bytes_per_token": 8.0, "utilization": 0.55, "wall_seconds": 30.0, "audit_ok": True,
               "utilization_by_learner": {"learner-0": 0.9, "learner-1": 0.2}}  # fmt: skip
    console = Console(width=200, record=True)
    print_summary(console, summary, Path("summary.json"))
    row = next(line for line in console.export_text().splitlines() if "lowest learner" in line)
    assert "learner-1 20.0% (busiest 90.0%" in row


def test_status_counts_in_the_runs_unit() -> None:
    """A preprocess's run counts samples: `diloco status` says so, not "tokens"."""
    detail = {"run_state": "running", "coordinator_epoch": 1, "chunks_done": 1, "chunks_total": 2,
              "chunks_quarantined": 0, "shards_total": 1, "shards_consumed": 0, "tokens_prepared": 320,
              "tokens_trained": 64, "tokens_merged": 32, "rounds": 1, "fragment_versions": [1],
              "unit": "samples", "workers": [
                  {"worker_id": "data-0", "role": "data", "alive": True, "state": "active",
                   "tokens_prepared": 320, "tokens_per_s": 32.0}]}  # fmt: skip
    console = Console(width=200, record=True)
    console.print(status_tables(detail))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "prepared 320, trained 64, merged 32" in line)
    assert "samples" in row and "samples/s" in text
    assert "tokens" not in text
    assert last_merge_text({"last_merge_s": 12.4}) == ", last merge 12 s ago" and not last_merge_text({})
    assert status_columns("tokens") == STATUS_COLUMNS
    # A learner named by the pusher watch: its id and reason as text (an id may hold brackets).
    console = Console(width=200, record=True)
    console.print(status_tables({**detail, "suspect_learners": {"[bold]x": "its deltas [red]differ"}}))
    text = console.export_text()
    assert "suspect [bold]x" in text and "its deltas [red]differ" in text
    assert "refused meanwhile" not in text
    console = Console(width=200, record=True)
    console.print(status_tables({**detail, "suspect_learners": {"x": "odd"}, "suspects_refused": True}))
    assert "odd (its pushes refused meanwhile)" in console.export_text()


def test_the_ddp_comparison_reads_the_right_way_round() -> None:
    assert than_ddp(1633.0, 1.0) == "1,633× more"
    # A run whose pushes carried few tokens sends more per token than DDP would: not "0× more".
    assert than_ddp(1633.0, 19561.0) == "12.0× less"


def test_a_final_evaluation_that_fails_keeps_the_runs_results_and_says_why(tmp_path: Path) -> None:
    """The run finished (a finished workdir takes no second job): its summary is written without
    an evaluation, with the reason, and the table says it failed rather than "no held-out data"."""
    from diloco.local.evaluation import evaluate_final_or_say_why, param_count
    from diloco.tokenizer import load_tokenizer

    cfg = RunConfig().with_overrides({"model.factory": "no_such_package_here.model:build"})
    assert param_count(cfg, 257) is None
    d = {"fragment_versions": [1], "eval_shards": [{"uri": str(tmp_path / "gone.shard"), "checksum": "0"}]}
    result = evaluate_final_or_say_why(d, cfg, tmp_path, load_tokenizer(cfg.data.tokenizer))
    assert result["eval_loss"] is None and "gone.shard" in result["final_eval_error"]
    summary = {"tokens_trained": 1000, "tokens_merged": 1000, "rounds": 4, "chunks": 2, "shards": 2,
               "wire_bytes_per_token": 8.0, "utilization": 0.9, "wall_seconds": 30.0, "audit_ok": True,
               **result}  # fmt: skip
    console = Console(width=200, record=True)
    print_summary(console, summary, Path("summary.json"))
    row = next(line for line in console.export_text().splitlines() if "eval loss" in line)
    assert "the final evaluation failed" in row and "no held-out data" not in row


def test_a_resumed_runs_rates_are_this_jobs_own(tmp_path: Path) -> None:
    """The counts are the run's (every life); the rates are this job's counts over this job's time:
    a third life once reported 3x its learners' speed, and "DDP: 74x more" on its wire bytes."""
    from diloco.local.outcome import RecordedRun
    from diloco.local.summary import summarize

    d = {"tokens_trained": 3_000_000, "tokens_merged": 2_800_000, "tokens_pushed": 2_900_000,
         "tokens_prepared": 4_000_000, "wire_bytes_in": 600_000, "wire_bytes_out": 400_000,
         "learner_kept_busy_seconds": 150.0, "workers": []}  # fmt: skip
    earlier = RecordedRun("running", 2_000_000, 1_900_000, 3_500_000, wire_bytes=200_000)
    s = summarize(d, RunConfig(), name="r", workdir=tmp_path, learners=2, data_workers=2, slow_learner=1.0,
                  train_seconds=100.0, total_seconds=110.0, minutes=0, earlier=earlier)  # fmt: skip
    assert s["tokens_trained"] == 3_000_000 and s["job_tokens_trained"] == 1_000_000
    assert s["trained_tokens_per_s"] == pytest.approx(10_000) and s["merged_tokens_per_s"] == pytest.approx(
        9_000
    )
    # The wire counts go on across coordinator lives: this job's are the run's less the earlier jobs'.
    assert s["wire_bytes_per_token"] == pytest.approx(0.8) and s["data_tokens_per_s"] == pytest.approx(5_000)
    assert (
        s["resumed_from"] == {"tokens_trained": 2_000_000, "tokens_merged": 1_900_000}
        and s["goodput"] is None
    )
    fresh = summarize(d, RunConfig(), name="r", workdir=tmp_path, learners=2, data_workers=2, slow_learner=1.0,
                      train_seconds=100.0, total_seconds=110.0, minutes=0)  # fmt: skip
    assert fresh["resumed_from"] is None and fresh["trained_tokens_per_s"] == pytest.approx(30_000)
    assert fresh["goodput"] is not None


def test_status_says_how_many_pushes_were_taken_refused_and_clipped() -> None:
    base = {"pushes_received": 1200, "pushes_refused": 3}
    assert pushes_text(base) == "1,200 taken, 3 refused"
    got = pushes_text({**base, "pushes_center_clipped": 2, "pushes_rows_only": 1})
    assert got == "1,200 taken, 3 refused, 2 clipped toward their fragment's mean step, 1 for their rows only"
