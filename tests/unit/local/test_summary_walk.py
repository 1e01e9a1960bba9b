"""summary.json and the result table as a new user's walk read them: a resumed job's start-up,
every evaluation, shares of learner time that add up, and figures that say what they are per."""

from pathlib import Path

from rich.console import Console

from diloco.coordinator.ledger import Ledger, ledger_path
from diloco.local.summary import job_startup_seconds, run_evals, time_shares
from diloco.views import print_summary, shards_text, status_tables
from tests.support import FakeClock

STARTUP = (
    "{date} INFO learner[1] diloco.learner: start-up: process 0.16s, imports 9.92s, join 0.05s, "
    "model 5.27s, pull 0.45s, first batch 1.07s, first step 1.27s (total 18.19s)"
)


def test_a_resumed_jobs_start_up_is_its_own_lives(tmp_path: Path) -> None:
    """The log holds the job before it too: its first life is the earlier job's (0.0 s before)."""
    from diloco.compute.startup import read_startups

    earlier, ours = (
        STARTUP.format(date="2026-12-01 13:04:07,492"),
        STARTUP.format(date="2026-12-01 14:00:00,000"),
    )
    (tmp_path / "learner-0.log").write_text(earlier + "\n" + ours + "\n")
    lives = read_startups((tmp_path / "learner-0.log").read_text())
    started = lives[1].first_step_at - 25.0  # this job began 25 s before its learner's first step
    assert job_startup_seconds(tmp_path, started) == 25.0


def test_the_summarys_evals_are_every_one_the_ledger_holds(tmp_path: Path) -> None:
    """The final status can be read before the evaluator reports the final model's evaluation."""
    assert run_evals(tmp_path) is None  # no ledger
    ledger_path(tmp_path).parent.mkdir(parents=True)
    ledger = Ledger(str(ledger_path(tmp_path)), clock=FakeClock())
    try:
        for i in range(4):
            ledger.record_eval("evaluator", [i], 1000 * i, 3.0 - i / 10, {"accuracy": 0.5}, 64, 1.5)
    finally:
        ledger.close()
    evals = run_evals(tmp_path)
    assert [e["tokens_merged"] for e in evals] == [0, 1000, 2000, 3000]
    assert evals[-1]["fragment_versions"] == [3] and evals[-1]["metrics"] == {"accuracy": 0.5}


def test_utilization_and_the_waits_are_shares_of_one_whole() -> None:
    """99.4% busy and 2.9% waiting on the syncer read as disjoint and add to over 100%: the final
    flush's syncer wait comes after the wall clock stopped."""
    w = {"wall_seconds": 100.0, "busy_seconds": 99.4, "sync_wait_seconds": 2.9, "data_stall_seconds": 0.1}
    shares = time_shares(w)
    assert sum(shares.values()) <= 1.0 + 1e-9
    assert shares["utilization"] < 0.994 and shares["sync_wait_share"] > 0.0
    # within the wall time, nothing changes
    assert (
        time_shares({"wall_seconds": 100.0, "busy_seconds": 90.0, "sync_wait_seconds": 5.0})["utilization"]
        == 0.9
    )


def test_the_result_table_says_what_each_rate_is_per() -> None:
    summary = {"tokens_trained": 1000, "tokens_merged": 1000, "rounds": 4, "chunks": 2, "shards": 2,
               "wire_bytes_per_token": 8.0, "utilization": 0.935, "sync_wait_share": 0.03, "wall_seconds": 30.0,
               "audit_ok": True, "data_tokens_per_s": 5000.0}  # fmt: skip
    console = Console(width=250, record=True)
    print_summary(console, summary, Path("summary.json"))
    text = console.export_text()
    assert "5,000 tokens prepared per second of the run's wall time" in text
    assert "each learner's last life" in text


def test_status_shards_and_worker_speeds_say_what_they_count() -> None:
    d = {"shards_total": 16, "shards_consumed": 0, "shards_started": 9}
    assert shards_text(d) == "16 (9 train with rows trained, 0 with every row merged)"
    detail = {"run_state": "running", "coordinator_epoch": 1, "chunks_done": 1, "chunks_total": 2,
              "chunks_quarantined": 0, "tokens_prepared": 320, "tokens_trained": 64, "tokens_merged": 32,
              "rounds": 1, "fragment_versions": [1], "workers": [], **d}  # fmt: skip
    console = Console(width=250, record=True)
    console.print(status_tables(detail))
    text = console.export_text()
    assert "9 train with rows trained" in text and "per second of work" in text


def test_the_ledger_reports_shards_partly_trained(tmp_path: Path) -> None:
    from tests.unit.coordinator.ledger_setup import ROWS, push, with_train_shard

    ledger = Ledger(str(tmp_path / "ledger.sqlite"), clock=FakeClock())
    try:
        (sid,) = with_train_shard(ledger)
        assert ledger.summary()["shards_started"] == 0
        ledger.lease_shard("L1", 30.0)
        assert push(ledger, "p1", [(sid, 0, ROWS // 2)]) is None
        summary = ledger.summary()
        assert (summary["shards_started"], summary["shards_consumed"]) == (1, 0)
        assert summary["train_tokens_prepared"] > 0
    finally:
        ledger.close()
