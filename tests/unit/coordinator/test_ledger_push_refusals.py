"""A push refused in record_push changes nothing of the ledger but its released leases; a push_id
recorded already is told apart from a refusal (two copies of one push arriving together)."""

import pytest

from diloco.coordinator.ledger import Ledger
from diloco.coordinator.ledger.rows import PushRecorded
from tests.unit.coordinator.ledger_setup import ROWS, TOKENS_PER_ROW, TTL, push, with_train_shard

OVERLAPPING, OUTSIDE = [(0, 0, 5), (0, 3, 7)], [(0, 8, ROWS + 1)]


def on_shard(spans, sid):
    return [(sid, a, b) for _, a, b in spans]


def snapshot(ledger: Ledger, push_id: str):
    """What a refused push must leave as it was: its row, its spans, the counters."""
    row = ledger.push_state(push_id)
    spans = ledger._q("SELECT shard_id, row_start, row_end FROM spans WHERE push_id = ?", (push_id,))
    return (
        None if row is None else dict(row),
        [tuple(s) for s in spans],
        ledger.counters(),
    )


@pytest.mark.parametrize("bad", [OVERLAPPING, OUTSIDE], ids=["overlapping", "outside"])
def test_a_refused_revived_push_keeps_its_dropped_row_and_the_counters(ledger, bad):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    ledger.next_epoch()  # its round is dropped by the restart: sent again, it is revived
    before = snapshot(ledger, "p1")
    assert before[0]["state"] == "dropped" and before[1] == [(sid, 0, 4)]
    reason = push(ledger, "p1", on_shard(bad, sid))
    assert isinstance(reason, str)
    assert snapshot(ledger, "p1") == before
    # Still revivable: a good copy of it is taken afresh.
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    assert ledger.push_state("p1")["state"] == "pending"
    assert ledger.counter("pushes_revived") == 1


@pytest.mark.parametrize("bad", [OVERLAPPING, OUTSIDE], ids=["overlapping", "outside"])
def test_a_refused_push_still_gives_back_its_released_shards(ledger, bad):
    (sid,) = with_train_shard(ledger)
    assert ledger.lease_shard("L1", TTL).shard_id == sid
    before = snapshot(ledger, "p1")
    assert isinstance(push(ledger, "p1", on_shard(bad, sid), released=[sid]), str)
    assert snapshot(ledger, "p1") == before
    # The learner let the shard go with the push: it is not held for nobody until its lease ends.
    assert ledger.lease_shard("L2", TTL).todo == [(0, ROWS)]


def test_a_push_recorded_already_is_not_recorded_again(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    before = snapshot(ledger, "p1")
    with pytest.raises(PushRecorded):
        push(ledger, "p1", [(sid, 0, 4)])
    assert snapshot(ledger, "p1") == before


def test_a_revived_push_is_revived_once(ledger):
    (sid,) = with_train_shard(ledger)
    assert push(ledger, "p1", [(sid, 0, 4)]) is None
    ledger.next_epoch()
    assert push(ledger, "p1", [(sid, 0, 4)]) is None  # the first copy sent again
    before = snapshot(ledger, "p1")
    with pytest.raises(PushRecorded):  # a second copy of it, read as dropped before the first's record
        push(ledger, "p1", [(sid, 0, 4)])
    assert snapshot(ledger, "p1") == before


def test_a_hand_in_s_row_less_push_is_backed_by_the_rows_its_first_push_named(ledger):
    """Data ran out: a learner's hand-in names every row it holds on its first push (fragment 1)
    and gives the shard back; the other fragment's push follows with no rows and nothing held.
    Each row backs one push of every fragment, so the rows just named back it (it was refused,
    and fragment 0's last steps lost, in every data-exhausted digits run)."""
    (sid,) = with_train_shard(ledger)
    ledger.join("L1", "compute", "h")
    assert ledger.lease_shard("L1", TTL).shard_id == sid
    shape = {"batch_size": 2, "fragments": 2, "inner_steps": 10}
    first = ledger.push_claim("L1", 1, "f1", [(sid, 0, ROWS)], 5, ROWS * TOKENS_PER_ROW, **shape)
    assert (first.refusal, first.tokens) == ("", ROWS * TOKENS_PER_ROW)
    assert ledger.record_push("f1", "L1", 1, 0, first.steps, first.tokens, [(sid, 0, ROWS)], [sid]) is None
    last = ledger.push_claim("L1", 0, "f0", [], 5, ROWS * TOKENS_PER_ROW, **shape)
    assert (last.refusal, last.steps, last.tokens) == ("", 5, ROWS * TOKENS_PER_ROW)
    # More than the rows named is never credited: a claim of twice as much gets them once.
    assert (
        ledger.push_claim("L1", 0, "f0x", [], 10, 2 * ROWS * TOKENS_PER_ROW, **shape).tokens
        == ROWS * TOKENS_PER_ROW
    )
    assert ledger.record_push("f0", "L1", 0, 0, last.steps, last.tokens, [], []) is None
    # Fragment 1 was credited those rows already, and nothing is held: no credit behind another.
    again = ledger.push_claim("L1", 1, "f1b", [], 5, ROWS * TOKENS_PER_ROW, **shape)
    assert again.refusal and again.tokens == 0
