"""On a small dataset every learner trains: four train shards, two learners, each mixing up to
four shards at once. Learner-0 once leased all four (its own used up, it took slot 1's while it
still held its own) and learner-1 trained nothing all run."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.support import QUICK_END, copy_corpus, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(180)
def test_two_learners_on_four_train_shards_both_train(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    corpus = copy_corpus(tmp_path / "corpus", 1_100_000)  # 5 chunks of the default size, 4 for training
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--dataset", str(corpus), "--minutes", "0.2", "--learners", "2", "--data-workers", "2",
         "--workdir", str(workdir), "--no-progress", "--set", "model.kwargs.n_layer=1",
         "--set", "eval.every_s=0", *QUICK_END],
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with sqlite3.connect(workdir / "state" / "ledger.sqlite") as db:
        train_shards = db.execute("SELECT COUNT(*) FROM shards WHERE split = 'train'").fetchone()[0]
        trained = dict(
            db.execute(
                "SELECT p.worker_id, COUNT(DISTINCT s.shard_id) FROM spans s "
                "JOIN pushes p ON p.push_id = s.push_id GROUP BY p.worker_id"
            ).fetchall()
        )
    assert train_shards == 4, "the corpus is meant to make four train shards"
    # Each trains its own dealt two; one that used its own up may take a third, never the other's
    # while that one still trains them.
    assert set(trained) == {"learner-0", "learner-1"} and min(trained.values()) >= 2, trained
