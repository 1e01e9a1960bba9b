"""What the pusher watch saw of each push is kept in the ledger (refused pushes too), so that a
restarted coordinator rebuilds each learner's watch (coordinator/pusher_watch.py), and each taken
push's deviation from the mean step for the centered clip; a ledger from before them gains the
columns, empty."""

import sqlite3

from diloco.coordinator.ledger import Ledger
from diloco.coordinator.pusher_watch import WATCH_PUSHES, restored
from tests.unit.coordinator.ledger_setup import TOKENS_PER_ROW, with_train_shard


def record(ledger, push_id, worker, row, watched, state="pending", fragment=0, loss=None):
    spans = [(1, row, row + 1)] if state == "pending" else []
    return ledger.record_push(
        push_id, worker, fragment, 0, 5, TOKENS_PER_ROW, spans, [], state=state,
        reason="" if state == "pending" else "refused", watched=(*watched, loss),
    )  # fmt: skip


def test_each_learners_last_pushes_come_back_oldest_first_refused_ones_too(ledger, clock) -> None:
    with_train_shard(ledger)
    for worker in ("L1", "L2", "gone"):
        ledger.join(worker, "compute", "h")
    ledger.leave("gone")
    record(ledger, "old", "L1", 0, (None, None, None))  # watched nothing (no momentum yet): not kept
    for i in range(WATCH_PUSHES + 3):
        clock.advance(1.0)
        # The shard has 10 rows: past them, pushes refused (a refused push is watched too).
        record(ledger, f"a{i}", "L1", 1 + i, (1.0 + i, 0.5, 0.7), state="pending" if i < 8 else "dropped",
               loss=3.0 + i)  # fmt: skip
    clock.advance(1.0)
    record(ledger, "b0", "L2", 0, (None, -0.4, None), state="dropped")
    record(ledger, "g0", "gone", 0, (2.0, 0.1, None), state="dropped")
    got = ledger.recent_watched(WATCH_PUSHES)
    assert set(got) == {"L1", "L2"}  # a learner that left has no watch to rebuild
    assert [r for _, r, _, _, _ in got["L1"]] == [1.0 + i for i in range(3, WATCH_PUSHES + 3)]
    assert [loss for *_, loss in got["L1"]] == [3.0 + i for i in range(3, WATCH_PUSHES + 3)]
    assert [t for t, *_ in got["L1"]] == sorted(t for t, *_ in got["L1"])
    assert got["L2"] == [(clock(), None, -0.4, 0, None)]
    watches = restored(got, clock(), 60.0)
    assert watches["L1"].ratio_median() is not None and watches["L2"].ratio_median() is None
    assert watches["L1"].loss_median() == 3.0 + 3 + WATCH_PUSHES // 2 - 0.5  # the last 16 losses' median


def test_the_last_pushes_of_each_fragment_come_back(ledger, clock) -> None:
    # A learner's watch judges each fragment on its own: a restart gives each its last pushes,
    # however many more of one fragment came since the other's.
    with_train_shard(ledger)
    ledger.join("L1", "compute", "h")
    record(ledger, "f1", "L1", 0, (9.0, 0.5, None), state="dropped", fragment=1)
    for i in range(WATCH_PUSHES + 2):
        clock.advance(1.0)
        record(ledger, f"f0-{i}", "L1", 0, (1.0 + i, 0.5, None), state="dropped")
    got = ledger.recent_watched(WATCH_PUSHES)["L1"]
    assert [(r, f) for _, r, _, f, _ in got] == [(9.0, 1)] + [
        (1.0 + i, 0) for i in range(2, WATCH_PUSHES + 2)
    ]


def test_a_ledger_from_before_the_watch_was_kept_gains_its_columns(tmp_path, clock) -> None:
    path = tmp_path / "ledger.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE pushes (push_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, fragment INTEGER NOT NULL, "
        "base_version INTEGER NOT NULL, steps INTEGER NOT NULL, tokens INTEGER NOT NULL, state TEXT NOT NULL, "
        "merged_version INTEGER, reason TEXT, received REAL NOT NULL, norm REAL)"
    )  # as it was made before the watch was kept
    db.commit()
    db.close()
    ledger = Ledger(str(path), clock=clock)
    try:
        assert ledger.recent_watched(WATCH_PUSHES) == {}
        with_train_shard(ledger)
        ledger.join("L1", "compute", "h")
        record(ledger, "p", "L1", 0, (1.5, 0.25, 0.9))
        assert ledger.recent_watched(WATCH_PUSHES) == {"L1": [(clock(), 1.5, 0.25, 0, None)]}
    finally:
        ledger.close()


def test_a_merged_push_gives_back_its_norm_and_deviation_and_an_older_one_its_norm_twice(
    tmp_path, clock
) -> None:
    ledger = Ledger(str(tmp_path / "ledger.sqlite"), clock=clock)
    try:
        with_train_shard(ledger)
        ledger.join("L1", "compute", "h")
        for i, deviation in enumerate((0.4, None)):  # None: recorded before deviations were kept
            clock.advance(1.0)
            ledger.record_push(
                f"p{i}", "L1", 0, 0, 5, TOKENS_PER_ROW, [(1, i, i + 1)], [], norm=2.0 + i,
                watched=(1.0, 0.5, deviation, None),
            )  # fmt: skip
        db = sqlite3.connect(tmp_path / "ledger.sqlite")
        db.execute("UPDATE pushes SET state = 'merged', merged_version = 1")  # as a merge commits them
        db.commit()
        db.close()
        assert ledger.recent_norms(0, 16, min_steps=5) == [("L1", 2.0, 0.4), ("L1", 3.0, 3.0)]
        assert ledger.recent_norms(0, 16, min_steps=6) == []  # shorter than H: not in the history
    finally:
        ledger.close()


def test_the_learners_whose_last_push_was_refused_as_named_are_known_after_a_restart(ledger, clock) -> None:
    with_train_shard(ledger)
    for worker in ("named", "back", "fine", "gone"):
        ledger.join(worker, "compute", "h")
    prefix = "its learner looks hostile"
    for i, (worker, reason) in enumerate(
        [("named", "x"), ("named", prefix + ": y"), ("back", prefix + ": y"), ("back", "other"),
         ("fine", "too stale"), ("gone", prefix + ": z")]
    ):  # fmt: skip
        clock.advance(1.0)
        ledger.record_push(f"p{i}", worker, 0, 0, 5, TOKENS_PER_ROW, [], [], state="dropped", reason=reason)
    ledger.leave("gone")
    assert ledger.last_refused_as(prefix) == {"named": prefix + ": y"}
