"""The rows a learner trained on since its last push: exact spans, whatever order batches come in."""

from __future__ import annotations

import torch

from diloco.compute.batch import Batch
from diloco.compute.rows import RowBook, Unpushed, each_row_once, release_fragment, rows_to_carry, span_tokens


def batch(shard: int, start: int, end: int, last: bool = False) -> Batch:
    rows = torch.zeros((end - start, 5), dtype=torch.int64)  # seq_len 4: 5 tokens a row
    return Batch.of_shard({"input_ids": rows}, shard, start, end, last)


def test_interleaved_shards_keep_one_span_each_while_rows_follow_on() -> None:
    u = Unpushed()
    for b in (
        batch(7, 0, 8),
        batch(9, 16, 24),
        batch(7, 8, 16),
        batch(9, 24, 32, last=True),
        batch(7, 16, 20),
    ):
        u.add(b)
    assert u.spans == [(7, 0, 20), (9, 16, 32)]
    assert u.released == [9]


def test_a_gap_starts_a_new_span() -> None:
    u = Unpushed()
    for b in (batch(3, 0, 8), batch(3, 40, 48), batch(3, 48, 56)):
        u.add(b)
    assert u.spans == [(3, 0, 8), (3, 40, 56)]


def rows(*spans: tuple[int, int, int]) -> Unpushed:
    u = Unpushed()
    for shard, a, b in spans:
        u.add(batch(shard, a, b))
    return u


def test_rows_ride_on_the_push_that_completes_every_fragment() -> None:
    # P = 2: rows trained before fragment 0's push ride on fragment 1's next push, not on this one.
    carried, awaiting, _ = rows_to_carry([], rows((1, 0, 8)), pushed=0, fragments=2)
    assert carried.spans == [] and [g.waiting for g in awaiting] == [{1}]
    carried, awaiting, _ = rows_to_carry(awaiting, rows((1, 8, 16)), pushed=1, fragments=2)
    assert carried.spans == [(1, 0, 8)] and [g.waiting for g in awaiting] == [{0}]
    carried, awaiting, _ = rows_to_carry(awaiting, Unpushed(), pushed=0, fragments=2)
    assert carried.spans == [(1, 8, 16)] and awaiting == []


def test_one_fragment_carries_its_rows_at_once() -> None:
    carried, awaiting, _ = rows_to_carry([], rows((4, 0, 8), (4, 8, 16)), pushed=0, fragments=1)
    assert carried.spans == [(4, 0, 16)] and awaiting == []


def test_a_released_shard_rides_with_its_last_rows() -> None:
    last = Unpushed()
    last.add(batch(2, 56, 64, last=True))
    carried, awaiting, _ = rows_to_carry([], last, pushed=1, fragments=3)
    carried, awaiting, _ = rows_to_carry(awaiting, Unpushed(), pushed=2, fragments=3)
    assert carried.released == [] and awaiting
    carried, awaiting, _ = rows_to_carry(awaiting, Unpushed(), pushed=0, fragments=3)
    assert carried.spans == [(2, 56, 64)] and carried.released == [2] and awaiting == []


def test_an_overwritten_fragment_stops_waiting_and_the_rows_ride_on_the_next_push() -> None:
    # Fragment 1 pushed with rows waiting for fragment 0, which is then overwritten by its merge
    # before it is pushed again (a learner with no more data): the rows wait for nothing more.
    _, awaiting, _ = rows_to_carry([], rows((5, 0, 8)), pushed=1, fragments=2)
    done, awaiting, _ = release_fragment(awaiting, 0)
    assert done.spans == [(5, 0, 8)] and awaiting == []
    # Overwriting a fragment nobody waits for changes nothing.
    _, awaiting, _ = rows_to_carry([], rows((6, 0, 8)), pushed=0, fragments=2)
    done, awaiting, _ = release_fragment(awaiting, 0)
    assert done.spans == [] and [g.waiting for g in awaiting] == [{1}]


def test_the_row_book_carries_rows_once_every_fragment_is_pushed_after_them() -> None:
    book = RowBook()
    book.trained(batch(3, 0, 8))
    assert book.carry(0, 2).spans == [] and not book.all_carried()
    book.trained(batch(3, 8, 16))
    assert book.carry(1, 2).spans == [(3, 0, 8)]  # fragment 1's push completes the first rows
    book.overwritten(0)  # fragment 0's merge overwrote what it held of the later rows
    assert book.all_carried() and book.resolved.spans == [(3, 8, 16)]
    assert book.carry(1, 2).spans == [(3, 8, 16)] and not book.resolved.spans


def test_a_hand_in_names_every_row_on_its_first_push() -> None:
    """Fragment 0 pushed at step 5 (its rows wait for fragment 1), then training stops at step 7:
    the hand-in's first push (fragment 1, pushed longest ago) names every row, waiting or fresh,
    and fragment 0's push follows with none. Pushed with their cover, the rows rode on the
    hand-in's last push, whose fragment may have no credit left: refused, they were lost."""
    book = RowBook()
    book.trained(batch(3, 0, 5))
    assert book.carry(0, 2).spans == []  # the learner's first push: its rows wait for fragment 1
    book.trained(batch(3, 5, 7))
    book.hand_in()
    assert book.all_carried()
    assert book.carry(1, 2).spans == [(3, 0, 5), (3, 5, 7)]
    assert book.carry(0, 2).spans == [] and not book.spans()


def test_the_steps_before_rows_that_still_wait_are_kept_work() -> None:
    """Goodput's kept work without a local state: the steps up to the newest rows every fragment
    has carried (a kill loses only those after), not nothing until every row at once is carried,
    which with fragments pushed in turn hardly ever happens."""
    book = RowBook()
    book.trained(batch(3, 0, 8))
    book.carry(0, 2, busy_s=1.0)  # the rows trained by 1.0 s wait for fragment 1
    assert book.kept_busy_s == 0.0
    book.trained(batch(3, 8, 16))
    book.carry(1, 2, busy_s=2.0)  # they ride now; the rows trained by 2.0 s wait for fragment 0
    assert book.kept_busy_s == 1.0 and not book.all_carried()
    book.trained(batch(3, 16, 24))
    book.carry(0, 2, busy_s=3.0)
    assert book.kept_busy_s == 2.0
    book.overwritten(1)  # fragment 1's merge: the rows trained by 3.0 s wait for nothing more
    assert book.kept_busy_s == 3.0


def test_the_row_book_gives_everything_back_at_the_end_and_its_copies_stand_apart() -> None:
    book = RowBook()
    book.trained(batch(4, 0, 8, last=True))
    book.carry(0, 2)  # waits for fragment 1
    book.trained(batch(5, 0, 8))
    copy = book.copy()
    back = book.take_all()
    assert sorted(back.spans) == [(4, 0, 8), (5, 0, 8)] and back.released == [4]
    assert book.spans() == [] and book.all_carried()
    assert sorted(copy.spans()) == [(4, 0, 8), (5, 0, 8)]  # the copy kept what the book held


def test_span_tokens_counts_rows_by_their_shard_and_unseen_shards_like_the_others() -> None:
    book = RowBook()
    for b in (batch(7, 0, 8), batch(9, 16, 24)):
        book.trained(b)
    assert span_tokens(book.spans(), {7: 5, 9: 5}) == 16 * 5
    assert span_tokens([*book.spans(), (3, 0, 2)], {7: 5, 9: 5}) == 18 * 5  # shard 3: resumed rows
    assert span_tokens([(3, 0, 2)], {}) == 0


def test_a_push_names_each_row_once_when_a_lapsed_lease_made_it_train_rows_again() -> None:
    """A learner whose lease lapsed and that leased the shard again trained rows 0-10 twice: the
    ledger refuses spans that overlap each other, the whole push with them, so the push names the
    union; spans that do not overlap go as they were."""
    again = [(1, 0, 10), (2, 0, 5), (1, 0, 4), (1, 4, 12)]
    assert each_row_once(again) == [(1, 0, 12), (2, 0, 5)]
    usual = [(1, 0, 10), (2, 0, 5), (1, 20, 30)]
    assert each_row_once(usual) is usual
