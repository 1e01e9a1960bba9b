"""A learner never makes a push the coordinator refuses for naming no rows: at most P − 1 pushes in
a row may name none (ledger/claims.py), and a hand-in names every row on its first push."""

from __future__ import annotations

from diloco.compute.learner import Learner
from diloco.compute.sync_channel import Merged
from tests.unit.compute.test_keep_overlap import learner_with_one_tensor, train


def spans(learner: Learner) -> list[list[tuple[int, int, int]]]:
    return [
        [(s.shard_id, s.row_start, s.row_end) for s in header.spans] for header, _ in learner.channel.jobs
    ]


def test_the_schedule_names_rows_once_every_fragment_is_pushed_after_them() -> None:
    learner = learner_with_one_tensor(keep=False)
    train(learner, 0.1, shard=1)
    learner._push(0)  # a learner's first push rides ahead of its rows: allowed, one of P − 1
    learner.frags[0].in_flight = False
    train(learner, 0.1, shard=2)
    learner._push(1)
    assert spans(learner) == [[], [(1, 0, 4)]] and learner.rowless_pushes == 0


def test_a_push_that_would_be_the_second_without_rows_names_the_rows_held() -> None:
    """Fragment 1's push still waits for its merge, so fragment 0 is pushed twice in a row: the
    second would name no rows (they wait for fragment 1), and the coordinator refuses a second
    such push in a row. It names the rows held instead."""
    learner = learner_with_one_tensor(keep=False)
    train(learner, 0.1, shard=1)
    learner._push(0)
    learner.frags[0].in_flight = False
    train(learner, 0.1, shard=2)
    learner._push(0)
    assert spans(learner) == [[], [(1, 0, 4), (2, 0, 4)]]
    assert learner.rows.all_carried() and learner.rowless_pushes == 0


def test_a_hand_in_names_every_row_on_the_push_of_the_fragment_pushed_longest_ago() -> None:
    learner = learner_with_one_tensor(keep=False)
    train(learner, 0.1, shard=1)
    learner._push(0)
    learner.frags[0].in_flight, learner.frags[0].steps = False, 0  # as if its merge were taken
    train(learner, 0.1, shard=2)
    assert learner._hand_in()
    # Fragment 1 (2 steps, never pushed) first, with every row; fragment 0 (1 step) after, none.
    assert [h.fragment for h, _ in learner.channel.jobs[1:]] == [1, 0]
    assert spans(learner)[1:] == [[(1, 0, 4), (2, 0, 4)], []]
    # Training goes on after the hand-in: the next push names the rows held at once, as the
    # hand-in's last push named none.
    for f in learner.frags:
        f.in_flight = False
    train(learner, 0.1, shard=3)
    learner._push(1)
    assert spans(learner)[-1] == [(3, 0, 4)]


def test_after_a_refused_push_the_next_that_would_name_no_rows_names_the_rows_held() -> None:
    """The ledger does not record a refused push: its count of row-less pushes in a row goes back
    to the last recorded push with rows, which the learner cannot see. After a refusal it assumes
    the worst (P − 1 already)."""
    learner = learner_with_one_tensor(keep=False)
    train(learner, 0.1, shard=1)
    learner._push(0)  # row-less: the ledger's count is 1 now
    learner.frags[0].in_flight = False
    train(learner, 0.1, shard=2)
    learner._push(1)  # names shard 1's rows ... and is refused (rows leased now to another)
    assert learner.rowless_pushes == 0
    learner._apply(Merged.full(1, 0, {}, accepted=False))
    assert learner.rowless_pushes == 1
    train(learner, 0.1, shard=3)
    learner._push(1)  # by the cover it would name none: the rows of shards 2 and 3 wait for fragment 0
    assert spans(learner)[-1] == [(2, 0, 4), (3, 0, 4)]
