"""A run's pushes replayed against the outlier check's reference (benchmarks/norm_ratios.py), from
a real ledger's pushes table: the history the coordinator keeps, not another."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from benchmarks.norm_ratios import push_ratios, summary
from diloco.coordinator.ledger import Ledger


def ledger_with(path: Path, pushes: list[tuple[str, int, float, str]]) -> Path:
    """`pushes`: (worker, steps, norm, state) of fragment 0, received one second apart."""
    Ledger(str(path)).close()
    with sqlite3.connect(path) as db:
        for i, (worker, steps, norm, state) in enumerate(pushes):
            db.execute(
                "INSERT INTO pushes (push_id, worker_id, fragment, base_version, steps, tokens, state, "
                "received, norm) VALUES (?, ?, 0, ?, ?, 100, ?, ?, ?)",
                (f"p{i}", worker, i, steps, state, 1000.0 + i, norm),
            )
    return path


def test_the_ratio_is_against_other_workers_full_pushes(tmp_path: Path) -> None:
    pushes = [
        ("a", 5, 0.01, "merged"),  # a short first push (the stagger): not in the history
        ("a", 10, 1.0, "merged"), ("b", 10, 1.0, "merged"), ("c", 10, 1.0, "merged"), ("d", 10, 1.0, "merged"),
        ("e", 10, 3.0, "merged"),  # others' median 1.0
        ("b", 10, 50.0, "dropped"),  # refused: compared, never in the history
        ("c", 10, 2.0, "merged"),  # others' (not c's own) median: of 1, 1, 1, 1, 3 (a, b, d, e) -> 1.0
    ]  # fmt: skip
    got = push_ratios(ledger_with(tmp_path / "ledger.sqlite", pushes), inner_steps=10)
    assert [round(p["ratio"], 3) for p in got] == [3.0, 50.0, 2.0]
    assert [p["worker"] for p in got] == ["e", "b", "c"] and got[1]["state"] == "dropped"
    stats = summary(got)
    assert stats["max"] == 50.0 and stats["above"]["10"] == 1 and stats["above"]["2"] == 2
    assert stats["median"] == pytest.approx(3.0)


def test_a_run_without_a_reference_says_so(tmp_path: Path) -> None:
    got = push_ratios(ledger_with(tmp_path / "ledger.sqlite", [("a", 10, 1.0, "merged")]), inner_steps=10)
    assert got == [] and summary(got) == {"pushes": 0}


def test_deviations_are_replayed_the_same_way_from_their_own_column(tmp_path: Path) -> None:
    # Norms all 1 (no push stands out by its norm); the last stands out by its deviation.
    pushes = [(w, 10, 1.0, "merged") for w in "abcde"]
    path = ledger_with(tmp_path / "ledger.sqlite", pushes)
    with sqlite3.connect(path) as db:
        for i, deviation in enumerate((0.5, 0.5, 0.5, 0.5, 2.0)):
            db.execute("UPDATE pushes SET deviation = ? WHERE push_id = ?", (deviation, f"p{i}"))
    assert [p["ratio"] for p in push_ratios(path, inner_steps=10)] == [1.0]
    assert [p["ratio"] for p in push_ratios(path, inner_steps=10, of="deviation")] == [4.0]
