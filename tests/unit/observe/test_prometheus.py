"""The coordinator's Prometheus metrics, collected from a status detail, parsed back as a scraper
reads them."""

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from diloco.observe.prometheus import CoordinatorMetrics, reason_label

DETAIL = {
    "run_state": "running", "coordinator_epoch": 3, "uptime_s": 12.5, "tokens_prepared": 1000,
    "tokens_leased": 800, "tokens_trained": 700, "tokens_merged": 600, "fragment_versions": [4, 5],
    "rounds": 9, "pushes_received": 11, "wire_by_rpc": {"push": {"received": 10, "sent": 2}},
    "chunks_by_state": {"done": 3, "pending": 1}, "chunks_quarantined": 0, "shards_total": 3,
    "evals": [{"loss": 2.5, "metrics": {"accuracy": 0.75}}],
    "workers": [
        {"worker_id": "l0", "role": "compute", "alive": True, "wall_seconds": 10.0, "busy_seconds": 9.0,
         "data_stall_seconds": 0.5, "last_loss": 3.25, "tokens_trained": 700, "last_push_age_s": 1.5},
        {"worker_id": "d0", "role": "data", "alive": False, "tokens_per_s": 5000.0},
    ],
}  # fmt: skip


def scrape(metrics: CoordinatorMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_status_detail_becomes_metrics_named_by_convention() -> None:
    metrics = CoordinatorMetrics(lambda: DETAIL)
    metrics.push_seconds.observe(0.2)
    metrics.refused("stale: base version 3 is 17 behind 20")
    got = scrape(metrics)
    assert got[("diloco_tokens_merged_total", ())] == 600
    assert got[("diloco_tokens_leased_total", ())] == 800
    assert got[("diloco_run_state", (("state", "running"),))] == 1
    assert got[("diloco_run_state", (("state", "finished"),))] == 0
    assert got[("diloco_merges_total", (("fragment", "1"),))] == 5
    assert got[("diloco_learner_utilization_ratio", (("worker", "l0"),))] == 0.9
    assert got[("diloco_learner_last_push_age_seconds", (("worker", "l0"),))] == 1.5
    assert got[("diloco_worker_up", (("role", "data"), ("worker", "d0")))] == 0
    assert got[("diloco_eval_metric", (("name", "accuracy"),))] == 0.75
    assert got[("diloco_wire_bytes_total", (("direction", "received"), ("rpc", "push")))] == 10
    assert got[("diloco_push_seconds_count", ())] == 1
    assert got[("diloco_pushes_refused_total", (("reason", "stale_base_version_is"),))] == 1


def test_a_refusal_reason_becomes_a_label_without_its_numbers() -> None:
    assert reason_label("stale: base version 3 is 17 behind 20") == "stale_base_version_is"
    assert reason_label("malformed") == "malformed"
    assert reason_label("") == "unknown"


def test_a_learner_serves_its_own_metrics_over_http() -> None:
    import urllib.request

    from diloco.observe.worker_metrics import serve_worker_metrics

    counters = {"inner_steps": 7, "tokens_trained": 896, "inner_loss": 2.5, "budget_wait_seconds": 1.5}
    server = serve_worker_metrics("learner", 0, "127.0.0.1", lambda: counters, lambda: "learner-3")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        server.shutdown()
    got = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["diloco_learner_inner_steps_total"] == ({"worker": "learner-3"}, 7)
    assert got["diloco_learner_inner_loss"][1] == 2.5 and got["diloco_learner_busy_seconds_total"][1] == 0
    assert got["diloco_learner_budget_wait_seconds_total"][1] == 1.5  # the token budget's end game


def test_transfers_are_the_means_of_one_push_and_one_learner_pull() -> None:
    metrics = CoordinatorMetrics(lambda: {})
    assert metrics.transfers()["push_seconds_mean"] == 0.0  # none yet: no division by zero
    for seconds, size in ((1.0, 100), (3.0, 300)):
        metrics.push_seconds.observe(seconds)
        metrics.push_bytes.observe(size)
    metrics.pull_seconds.labels(role="compute").observe(2.0)
    metrics.pull_bytes.labels(role="compute").observe(400)
    metrics.pull_seconds.labels(role="evaluator").observe(50.0)  # not a learner's: left out
    t = metrics.transfers()
    assert (t["push_seconds_mean"], t["push_bytes_mean"], t["pushes"]) == (2.0, 200.0, 2)
    assert (t["pull_seconds_mean"], t["pull_bytes_mean"], t["pulls"]) == (2.0, 400.0, 1)
