"""Merge safety against a real coordinator, round 2 of the red team (/work/walkR2 REPORT, defects
2 and 3): the rows a learner holds credit one push of each fragment, not every push; and the rows
a lease hands out are its holder's, whoever held the shard before."""

from __future__ import annotations

import math
import time
from pathlib import Path

import grpc
import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.audit import audit
from diloco.v1 import coordinator_pb2 as pb
from tests.support import tiny_coordinator
from tests.unit.security.test_merge_attacks import header, refused, small

H = RunConfig().train.inner_steps
BATCH = RunConfig().train.batch_size
# batch 16: the credit of rows to steps below is counted at the default batch
OVERRIDES = {"sync.max_staleness": 1000, "data.epochs": 4, "train.batch_size": 16}


def credited(running, push_id: str) -> tuple[int, int]:
    row = running.ledger.push_state(push_id)
    return row["steps"], row["tokens"]


def per_row_of(running, shard_id: int) -> int:
    row = running.ledger._q("SELECT rows, tokens FROM shards WHERE id = ?", (shard_id,))[0]
    return row["tokens"] // row["rows"]


def of_fragment(running, init: dict[str, torch.Tensor], fragment: int) -> dict[str, torch.Tensor]:
    """The tensors of `init` in one fragment (what a push of that fragment sends)."""
    return {n: t for n, t in init.items() if n in running.service.fragments[fragment].names}


def full(h: pb.TensorHeader, fragment: int = 0) -> pb.TensorHeader:
    """A header claiming H whole steps of rows (what a learner's push of a fragment reports)."""
    h.fragment, h.inner_steps, h.tokens = fragment, H, H * BATCH * 129
    return h


@pytest.mark.timeout(120)
def test_held_rows_credit_one_push_per_fragment(tiny_corpus: Path, tmp_path: Path) -> None:
    """Red team round 2, defect 2: 1-row and row-less pushes in turn, each claiming H steps, were
    each credited the whole held shard: 20 merged pushes, 20 shards' tokens from one shard."""
    with tiny_coordinator(tiny_corpus, tmp_path, {**OVERRIDES, "sync.fragments": 2}) as (
        running,
        learner,
        init,
    ):
        frag0, frag1 = of_fragment(running, init, 0), of_fragment(running, init, 1)
        shard = learner.lease_shard()
        per_row = per_row_of(running, shard.shard_id)
        # A learner's first push (P − 1 = 1 of them) rides ahead of its rows on the held shard.
        assert learner.push(full(header(shard.shard_id, None, "ahead")), small(frag0)).accepted
        steps, tokens = credited(running, "ahead")
        assert tokens <= shard.rows * per_row and steps <= math.ceil(shard.rows / BATCH)
        # A second row-less push in a row is refused, whatever rows back it.
        err = refused(learner, full(header(shard.shard_id, None, "ahead-2"), 1), small(frag1))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "such pushes" in err.details()
        # A 1-row push is credited its row and at most P − 1 intervals of H/P steps (rows its
        # learner trained that wait for their cover, as after a catch-up push), not the shard.
        assert learner.push(full(header(shard.shard_id, (0, 1), "one-row"), 1), small(frag1)).accepted
        rows = min(1 + H * BATCH // 2, shard.rows)  # and its budget: the rows named and held
        assert credited(running, "one-row") == (math.ceil(rows / BATCH), rows * per_row)
        # A second row-less push after it: fragment 0 was credited the held rows already.
        err = refused(learner, full(header(shard.shard_id, None, "ahead-again")), small(frag0))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "credited already" in err.details()
        # Fresh rows of this shard credit fragment 0 nothing more: its held rows were counted off
        # against them ahead (a learner's later rows lie in shards it leases later). The push is
        # taken for its rows only: they are recorded, trained and merged, and its delta is not.
        reply = learner.push(full(header(shard.shard_id, (1, 3), "fresh")), small(frag0, scale=1.0))
        assert reply.accepted and "no credit left" in reply.reason
        fresh = running.ledger.push_state("fresh")
        assert (fresh["state"], fresh["steps"], fresh["tokens"]) == ("merged", 0, 0)
        assert fresh["merged_version"] == reply.version + 1  # the learner takes that version at once
        more = learner.lease_shard()
        assert learner.push(full(header(more.shard_id, (0, 4), "more")), small(frag0)).accepted
        _, tokens = credited(running, "more")
        assert tokens <= (4 + H * BATCH // 2) * per_row_of(running, more.shard_id)
        total = running.ledger._q(
            "SELECT fragment, SUM(tokens) t FROM pushes WHERE worker_id = ? AND state != 'dropped' GROUP BY fragment",
            (learner.worker_id,),
        )
        held = running.ledger._q(
            "SELECT SUM(tokens) FROM shards WHERE id IN (?, ?)", (shard.shard_id, more.shard_id)
        )[0][0]
        # Each fragment's pushes are credited at most the rows leased, each once.
        assert all(r["t"] <= held for r in total), [tuple(r) for r in total]


@pytest.mark.timeout(120)
def test_one_fragment_pushes_are_credited_their_own_rows(tiny_corpus: Path, tmp_path: Path) -> None:
    """With one fragment every push names the rows its steps trained: a 1-row push is one row."""
    with tiny_coordinator(tiny_corpus, tmp_path, OVERRIDES) as (running, learner, init):
        shard = learner.lease_shard()
        per_row = per_row_of(running, shard.shard_id)
        for i in range(3):
            assert learner.push(
                full(header(shard.shard_id, (i, i + 1), f"r{i}")), small(init, seed=i)
            ).accepted
            assert credited(running, f"r{i}") == (1, per_row)
        err = refused(learner, full(header(shard.shard_id, None, "none")), small(init))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        # An honest push of H steps of rows is credited all of it.
        rows = min(shard.rows - 3, H * BATCH)
        h = full(header(shard.shard_id, (3, 3 + rows), "honest"))
        h.inner_steps, h.tokens = math.ceil(rows / BATCH), rows * per_row
        assert learner.push(h, small(init, seed=9)).accepted
        assert credited(running, "honest") == (math.ceil(rows / BATCH), rows * per_row)


def lease_to(running, worker_id: str, shard_id: int) -> None:
    """The shard leased to `worker_id` now (as lease_shard would when its turn comes)."""
    running.ledger._q(
        "UPDATE shards SET state = 'leased', holder = ?, lease_expires = ? WHERE id = ?",
        (worker_id, time.time() + 600, shard_id),
    )


@pytest.mark.timeout(120)
def test_a_past_holder_cannot_take_rows_leased_to_another(tiny_corpus: Path, tmp_path: Path) -> None:
    """Red team round 2, defect 3: a learner that held a shard and gave it back named the rows the
    new holder was training (a zero delta): accepted, and the holder's own push was refused."""
    with tiny_coordinator(tiny_corpus, tmp_path, OVERRIDES) as (running, evil, init):
        honest = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        honest.join()
        try:
            shard = evil.lease_shard()
            assert evil.push(header(shard.shard_id, (0, 10), "evil-own"), small(init)).accepted
            running.ledger.release_shards(evil.worker_id, [shard.shard_id])
            lease_to(running, honest.worker_id, shard.shard_id)
            counters = running.ledger.counters()
            zero = {n: torch.zeros_like(t) for n, t in init.items()}
            err = refused(evil, header(shard.shard_id, (20, shard.rows), "pre-empt"), zero)
            # INVALID_ARGUMENT: refused, but not as an identity (an honest learner paused past its
            # lease sends such a push too, and must train on: PERMISSION_DENIED ends a learner).
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "leased now" in err.details()
            assert running.ledger.push_state("pre-empt") is None
            assert running.ledger.counters()["pushes_refused"] == counters.get("pushes_refused", 0) + 1
            # A push naming its own rows too: those count, the holder's are cut out.
            mixed = header(shard.shard_id, (20, 30), "mixed")
            other = evil.lease_shard().shard_id
            mixed.spans.add(shard_id=other, row_start=0, row_end=5)
            assert evil.push(mixed, small(init, seed=1)).accepted
            assert running.ledger._q("SELECT shard_id FROM spans WHERE push_id = 'mixed'")[0][0] == other
            # The holder's push of the rows its lease gave it goes through.
            reply = honest.push(header(shard.shard_id, (20, shard.rows), "holder"), small(init, seed=2))
            assert reply.accepted, reply
            got = running.ledger._q("SELECT row_start, row_end FROM spans WHERE push_id = 'holder'")
            assert [tuple(r) for r in got] == [(20, shard.rows)]
        finally:
            honest.close()


@pytest.mark.timeout(120)
def test_a_resumed_learner_keeps_rows_of_a_lapsed_lease_nobody_holds(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """A learner back from kill -9 sends rows of a lease that lapsed while it was down: taken
    while nobody holds the shard, and cut (not its other rows) once another worker leases it."""
    with tiny_coordinator(tiny_corpus, tmp_path, OVERRIDES) as (running, learner, init):
        shard = learner.lease_shard()
        running.ledger.release_shards(learner.worker_id, [shard.shard_id])  # the lease lapsed
        assert learner.push(header(shard.shard_id, (0, 10), "journal"), small(init)).accepted
        # A shard leased to another worker between the claim and the record: cut there too.
        lease_to(running, "someone-else", shard.shard_id)
        assert (
            running.ledger.record_push(
                "late", learner.worker_id, 0, 0, 1, 129, [(shard.shard_id, 10, 20)], []
            )
            is None
        )
        assert running.ledger._q("SELECT 1 FROM spans WHERE push_id = 'late'") == []


def settled(running, fragment: int, within_s: float = 20.0) -> int:
    """The fragment's version once no push of it waits to merge (the merger runs on its own)."""
    frag = running.service.fragments[fragment]
    deadline = time.monotonic() + within_s
    while frag.pending or frag.sum.folding:
        assert time.monotonic() < deadline, "pushes still waiting to merge"
        time.sleep(0.05)
    return frag.version


@pytest.mark.timeout(120)
def test_own_fresh_rows_with_no_credit_left_are_recorded_and_their_delta_not_merged(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """A resumed learner that trained steps twice had its last push refused ("credited already"):
    its rows were lost, leased again, trained again and refused again. Such a push is now taken for
    its rows only: they count as trained and merged, its delta moves nothing, a retry of it is
    answered the same, and the audit holds."""
    with tiny_coordinator(tiny_corpus, tmp_path, {**OVERRIDES, "sync.fragments": 2}) as (
        running,
        learner,
        init,
    ):
        frag0, frag1 = of_fragment(running, init, 0), of_fragment(running, init, 1)
        shard = learner.lease_shard()
        # Fragment 0's credit is spent ahead on the held rows, then by a push of every row but two.
        assert learner.push(full(header(shard.shard_id, None, "ahead")), small(frag0)).accepted
        assert learner.push(full(header(shard.shard_id, (0, 1), "one-row"), 1), small(frag1)).accepted
        version = settled(running, 0)
        settled(running, 1)
        before = {n: t.clone() for n, t in running.service.fragments[0].params.items()}
        counters = running.ledger.counters()
        pushed = full(header(shard.shard_id, (1, 3), "no-credit"))
        pushed.version = version
        reply = learner.push(pushed, small(frag0, scale=1.0))
        assert reply.accepted and "no credit left" in reply.reason, reply
        assert reply.version == version - 1  # its rows merged at the current version: taken at once
        row = running.ledger.push_state("no-credit")
        assert (row["state"], row["steps"], row["tokens"], row["merged_version"]) == ("merged", 0, 0, version)
        spans = running.ledger._q(
            "SELECT shard_id, row_start, row_end FROM spans WHERE push_id = 'no-credit'"
        )
        assert [tuple(r) for r in spans] == [(shard.shard_id, 1, 3)]
        per_row = per_row_of(running, shard.shard_id)
        after = running.ledger.counters()
        assert after["tokens_merged"] - counters.get("tokens_merged", 0) == 2 * per_row
        assert after["pushes_rows_only"] == counters.get("pushes_rows_only", 0) + 1
        # Its delta merged nothing: the fragment is as it was, at the same version.
        assert settled(running, 0) == version
        for n, t in running.service.fragments[0].params.items():
            assert torch.equal(t, before[n]), n
        # A retry after a lost reply gets the same answer, and changes nothing.
        again = learner.push(pushed, small(frag0, scale=1.0))
        assert (again.accepted, again.version) == (True, version - 1)
        assert running.ledger.counters()["tokens_merged"] == after["tokens_merged"]
        # Sent again under a new id (a life resumed from before it): re-sent work, refused.
        pushed.push_id = "no-credit-again"
        refusal = learner.push(pushed, small(frag0))
        assert not refusal.accepted and "re-sent work" in refusal.reason
        report = audit(tmp_path, check_files=False)
        assert report.ok, report.violations
