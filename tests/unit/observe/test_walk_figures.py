"""Figures a new user's walk found wrong: transfers over every coordinator life, push counts that
match their means, refusal series from 0, one name per metric, progress rates over a window
longer than the merge spacing, TensorBoard steps that increase, JSON lines for a watch."""

from pathlib import Path

from diloco.config import RunConfig
from diloco.observe import events as events_module
from diloco.observe.events import ProgressWindow, RunEvents
from diloco.observe.http import history
from diloco.observe.prometheus import CoordinatorMetrics, reason_label
from diloco.observe.watch import json_lines
from tests.support import FakeClock, start_coordinator_here
from tests.unit.observe.test_prometheus import scrape


def test_push_counts_name_the_pushes_each_mean_is_over() -> None:
    """push_seconds times every PushDelta call (tensor-less "nothing this round" ones too),
    push_bytes only those with tensors: each mean says its own count."""
    metrics = CoordinatorMetrics(lambda: {})
    for seconds in (1.0, 2.0, 3.0):
        metrics.push_seconds.observe(seconds)
    for size in (100, 300):  # the third push carried no tensors
        metrics.push_bytes.observe(size)
    t = metrics.transfers()
    assert (t["pushes"], t["push_seconds_mean"]) == (3, 2.0)
    assert (t["pushes_with_tensors"], t["push_bytes_mean"]) == (2, 200.0)


def test_transfers_go_on_across_coordinator_lives() -> None:
    first = CoordinatorMetrics(lambda: {})
    first.push_seconds.observe(1.0)
    first.push_bytes.observe(100)
    first.pull_seconds.labels(role="compute").observe(4.0)
    saved = first.transfer_counts()
    second = CoordinatorMetrics(lambda: {})
    second.restore_transfers(saved)
    second.restore_transfers(saved)  # once per life: a second restore adds nothing
    second.push_seconds.observe(3.0)
    second.push_bytes.observe(300)
    t = second.transfers()
    assert (t["pushes"], t["push_seconds_mean"], t["push_bytes_mean"], t["pulls"]) == (2, 2.0, 200.0, 1)


def test_a_restarted_coordinator_reports_every_lifes_transfers(tiny_corpus: Path, tmp_path: Path) -> None:
    """The transfer counts are saved beside the wire counts (each progress sample, and at stop); the
    next life restores them: status's `transfers` were the last life's alone (14 pushes of 29)."""
    cfg = RunConfig().with_overrides({"data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536})
    first = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        for _ in range(3):
            first.service.metrics.push_seconds.observe(1.0)
    finally:
        first.stop()
    second = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        second.service.metrics.push_seconds.observe(1.0)
        assert second.service.status_detail()["transfers"]["pushes"] == 4
    finally:
        second.stop()


def test_refusal_series_are_there_at_zero_before_the_first_refusal() -> None:
    got = scrape(CoordinatorMetrics(lambda: {"run_state": "running", "coordinator_epoch": 1, "uptime_s": 0,
                                             "fragment_versions": [], "rounds": 0, "pushes_received": 0,
                                             "chunks_quarantined": 0, "shards_total": 0, "workers": []}))  # fmt: skip
    assert got[("diloco_pushes_refused_total", (("reason", reason_label("stalled stream")),))] == 0
    stale = reason_label("push is 3 version(s) stale (based on 1, now 4; max staleness 2)")
    assert got[("diloco_pushes_refused_total", (("reason", stale),))] == 0
    assert got[("diloco_calls_refused_total", (("rpc", "PushDelta"),))] == 0
    assert got[("diloco_calls_refused_total", (("rpc", "Join"),))] == 0


def test_the_coordinators_learner_tokens_metric_is_not_the_learners_own_name() -> None:
    detail = {"run_state": "running", "coordinator_epoch": 1, "uptime_s": 0, "fragment_versions": [],
              "rounds": 0, "pushes_received": 0, "chunks_quarantined": 0, "shards_total": 0,
              "workers": [{"worker_id": "l0", "role": "compute", "alive": True, "tokens_trained": 7}]}  # fmt: skip
    names = {name for name, _ in scrape(CoordinatorMetrics(lambda: detail))}
    assert "diloco_learner_tokens_trained_total" not in names  # the learner's /metrics serves it
    assert "diloco_learner_life_tokens_trained_total" in names


def test_progress_rates_do_not_alternate_with_merges_wider_than_a_sample() -> None:
    """Samples every 5 s, a merge of 100k tokens every 10 s: 10k tokens/s, not 20k, 0, 20k, 0."""
    window = ProgressWindow(window_s=30.0)
    rates = []
    for i in range(20):
        merged = (i // 2) * 100_000
        rates.append(window.add(5.0 * i, merged, wire=merged * 8))
    steady = [r["merged_tokens_per_s"] for r in rates[8:]]
    assert all(8_000 <= r <= 12_000 for r in steady), steady
    assert all(r["wire_bytes_per_token"] == 8.0 for r in rates[8:])


def test_recorded_progress_events_carry_the_windowed_rate(tmp_path: Path) -> None:
    clock = FakeClock()
    events = RunEvents(tmp_path, clock=clock, tensorboard=False)
    for i in range(20):
        # what the coordinator measured over the last 5 s alone: 20k or 0
        events.record("progress", tokens_merged=(i // 2) * 100_000, merged_tokens_per_s=20_000.0 * (i % 2))
        clock.advance(5)
    events.close()
    curve = [v for _, v in history(RunEvents(tmp_path, tensorboard=False).recent())["merged_tokens_per_s"]]
    assert curve and min(curve[8:]) >= 8_000, curve


def test_tensorboard_steps_of_a_tag_increase(tmp_path: Path, monkeypatch) -> None:
    """Learner reports between two merges share one tokens_merged: each written at its own step."""
    written: list[tuple[str, int]] = []

    class Writer:
        def add_scalar(self, tag, value, global_step, walltime):  # noqa: ANN001, ANN201
            written.append((tag, global_step))

        def close(self) -> None:
            pass

    monkeypatch.setattr(events_module, "_tensorboard_writer", lambda directory: Writer())
    events = RunEvents(tmp_path, clock=FakeClock())
    for merged in (0, 0, 0, 640, 640):
        events.record("learner", worker_id="l0", loss=3.0, utilization=0.9, tokens_merged=merged)
    events.close()
    steps = [step for tag, step in written if tag == "learner/l0/loss"]
    assert steps == sorted(set(steps)) and len(steps) == 5 and steps[3] == 640


def test_a_json_watch_streams_one_line_per_refresh() -> None:
    out: list[str] = []
    show = json_lines(out.append)
    show({"run_state": "running"}, None)
    show(None, "coordinator unreachable since 10:00:00 (5 s): refused")
    assert out == [
        '{"run_state": "running"}\n',
        '{"unreachable": "coordinator unreachable since 10:00:00 (5 s): refused"}\n',
    ]
