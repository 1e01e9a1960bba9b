"""The evaluator's decisions on a moving clock, the held-out rows it reads, and what the
coordinator keeps of its reports (the ledger's evals and eval split)."""

import math

import pytest

from diloco.coordinator.ledger import ChunkLease, Ledger
from diloco.coordinator.service.evals import MAX_EVAL_METRICS, eval_report_problem
from diloco.evaluator import eval_due
from diloco.v1 import coordinator_pb2 as pb
from tests.support import FakeClock
from tests.unit.coordinator.test_ledger import TTL, complete, make


def due(
    now=100.0,
    last_at=None,
    every_s=30.0,
    versions=(2, 2),
    evaluated=None,
    ready=64,
    wanted=64,
    done=False,
    merges=0,
):
    return eval_due(now, last_at, every_s, list(versions), evaluated, ready, wanted, done, merges)


def test_the_first_merged_model_is_evaluated_once_the_rows_are_there() -> None:
    assert not due(versions=()).due
    assert due(versions=(1, 0)).reason == "no merged model yet"
    assert not due(ready=10).due and "10/64" in due(ready=10).reason
    assert due(ready=10, done=True).due  # the whole split holds fewer rows than asked for
    assert not due(ready=0, done=True).due
    assert due().due


def test_evaluations_are_spaced_and_never_repeat_a_model() -> None:
    assert not due(now=110.0, last_at=100.0).due
    assert "20.0s" in due(now=110.0, last_at=100.0).reason
    assert due(now=130.0, last_at=100.0).due
    same = due(now=1000.0, last_at=100.0, evaluated=[2, 2])
    assert not same.due and "already evaluated" in same.reason
    # A finished run's final model is evaluated at once (the caller passes every_s = 0).
    assert due(now=101.0, last_at=100.0, every_s=0.0, evaluated=[2, 1]).due


def test_evaluations_can_come_every_so_many_merges_or_seconds_whichever_first() -> None:
    by_merges = {"now": 101.0, "last_at": 100.0, "every_s": 0.0}
    assert not due(**by_merges, versions=(3, 2), evaluated=[2, 1], merges=4).due
    assert "2 merge(s)" in due(**by_merges, versions=(3, 2), evaluated=[2, 1], merges=4).reason
    assert due(**by_merges, versions=(4, 3), evaluated=[2, 1], merges=4).due
    both = {"now": 101.0, "last_at": 100.0, "every_s": 30.0, "merges": 4}
    assert "29.0s or 2 merge(s)" in due(**both, versions=(3, 2), evaluated=[2, 1]).reason
    assert due(**{**both, "now": 131.0}, versions=(3, 2), evaluated=[2, 1]).due


def request(**fields) -> pb.ReportEvalRequest:
    return pb.ReportEvalRequest(**{"fragment_versions": [3, 3], "loss": 2.5, **fields})


def test_a_report_is_refused_unless_it_names_every_fragment_with_finite_numbers() -> None:
    assert eval_report_problem(request(), 2) == ""
    assert "1 fragment versions for 2" in eval_report_problem(request(fragment_versions=[3]), 2)
    assert "finite" in eval_report_problem(request(loss=math.inf), 2)
    assert "accuracy" in eval_report_problem(request(metrics={"accuracy": math.nan}), 2)
    many = {f"m{i}": 1.0 for i in range(MAX_EVAL_METRICS + 1)}
    assert "more than" in eval_report_problem(request(metrics=many), 2)


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(str(tmp_path / "ledger.sqlite"), clock=FakeClock())
    yield led
    led.close()


def test_the_eval_split_is_read_in_chunk_order_up_to_the_first_chunk_not_prepared(ledger) -> None:
    make(ledger, ["eval", "train", "eval", "eval"])  # eval chunks 1, 3 and 4
    leased = []
    while isinstance(lease := ledger.lease_chunk("d1", TTL), ChunkLease):
        leased.append(lease.chunk_id)
    assert sorted(leased) == [1, 2, 3, 4]
    complete(ledger, "d1", 3)
    assert ledger.eval_split() == {"shards": [], "complete": False, "chunks": 3}
    complete(ledger, "d1", 1)
    split = ledger.eval_split()
    assert [s["uri"] for s in split["shards"]] == ["file:///shards/1.zst", "file:///shards/3.zst"]
    assert not split["complete"]
    assert ledger.fail_chunk("d1", 4, "bad input", max_attempts=1)  # quarantined: never prepared
    assert ledger.eval_split()["complete"]


def test_evaluations_are_kept_in_order_and_the_last_ones_returned(ledger) -> None:
    for i in range(5):
        ledger.record_eval("evaluator", [i, i], 100 * i, 3.0 - i / 10, {"accuracy": i / 10}, 64, 0.5)
    everything = ledger.evals()
    assert [e["fragment_versions"] for e in everything] == [[i, i] for i in range(5)]
    last = ledger.evals(last=2)
    assert [e["tokens_merged"] for e in last] == [300, 400]
    assert last[-1]["metrics"] == {"accuracy": 0.4} and last[-1]["loss"] == pytest.approx(2.6)
