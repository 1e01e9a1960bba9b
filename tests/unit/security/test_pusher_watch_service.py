"""A learner whose deltas go against the other learners', on a real coordinator: within every norm
bound, so each push is merged, and named for it in Status, in Prometheus and once in the log; the
honest learners beside it are not (coordinator/pusher_watch.py). With sync.refuse_suspects its
pushes are refused from the one that gets it named, the others' all taken, and a round that needs
every learner (quorum 0) no longer waits for it; a restart of the coordinator keeps it named."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.coordinator.agreement import AGAINST
from diloco.coordinator.pusher_watch import MIN_WATCHED, SUSPECT_REFUSAL
from diloco.v1 import coordinator_pb2 as pb
from tests.support import start_coordinator_here, tiny_coordinator
from tests.unit.security.test_merge_attacks import header

# H = 10 steps at the fixture's batch of 1: each push's 10 rows are a full H. The rule of each
# learner's direction against the others' own off (it names the hostile at its 2nd push: the last
# test): the tests before are of the cosine to the momentum, and of what naming does.
OVERRIDES = {
    "sync.max_staleness": 1000,
    "data.epochs": 4,
    "train.inner_steps": 10,
    "sync.overlap_steps": 0,
    "sync.suspect_disagreement": 0,
}
# The last tests': every rule at its default, named pushes refused.
DIRECTIONS = {
    **{k: v for k, v in OVERRIDES.items() if k != "sync.suspect_disagreement"},
    "sync.refuse_suspects": True,
}
ROUNDS = 8


def push_rounds(
    running,
    learners: list[CoordinatorClient],
    init: dict,
    shards: list[int],
    rounds: range,
    why: str = "does not go",
    shared: float = 1.0,
) -> list[int]:
    """Each learner pushes once a round, the last one (the hostile) its delta against the others'
    way at their size (no norm rule names it); the rounds in which its push was refused. With
    `shared` 0 every delta is noise alone: no learner can be told apart."""
    g = torch.Generator().manual_seed(0)
    way = {n: torch.randn(t.shape, generator=g) * 1e-4 * shared for n, t in init.items()}  # the data's way
    refused = []
    for i in rounds:
        for k, learner in enumerate(learners):
            sign = -1.0 if k == len(learners) - 1 else 1.0
            delta = {n: sign * way[n] + torch.randn(t.shape, generator=g) * 5e-5 for n, t in init.items()}
            h = header(shards[k], (10 * i, 10 * i + 10), f"{k}-{i}")
            h.version = running.service.fragments[0].version
            reply = learner.push(h, delta)
            if k == len(learners) - 1 and not reply.accepted:
                assert reply.reason.startswith(SUSPECT_REFUSAL) and why in reply.reason, reply.reason
                refused.append(i)
            else:
                assert reply.accepted, reply
    return refused


def all_merged(running, received: int) -> None:
    deadline = time.monotonic() + 30
    while running.ledger.counters().get("pushes_received", 0) < received:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Every accepted push merged: the last rounds closed on the honest two's pushes (well
    # before the refused learner's heartbeats would lapse and end the wait anyway).
    deadline = time.monotonic() + 10
    while any(f.pending for f in running.service.fragments):
        assert time.monotonic() < deadline, "a round waits for the refused learner"
        time.sleep(0.05)


def joined(running, first: CoordinatorClient, more: int) -> tuple[list[CoordinatorClient], list[int]]:
    """`first` and `more` learners joined to the running coordinator, each with a shard leased."""
    others = [CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE) for _ in range(more)]
    for learner in others:
        learner.join()
    learners = [first, *others]
    return learners, [learner.lease_shard().shard_id for learner in learners]


def stopped(running, learners: list[CoordinatorClient]) -> Any:
    """The learners closed and the coordinator stopped; its config, to start it again with."""
    for learner in learners:
        learner.close()
    config = running.service.config
    running.stop()
    return config


@contextlib.contextmanager
def restarted(config, workdir: Path, ids: list[str]) -> Iterator[tuple[Any, list[CoordinatorClient]]]:
    """The coordinator started again on `workdir` with `config`, and the learners `ids` connected
    to it again; both closed after."""
    again = start_coordinator_here(config, str(workdir), "127.0.0.1")
    back = [CoordinatorClient(f"127.0.0.1:{again.port}", pb.ROLE_COMPUTE, worker_id=w) for w in ids]
    try:
        yield again, back
    finally:
        for learner in back:
            learner.close()
        again.stop()


def samples(running, family_name: str, label: str) -> dict[str, float]:
    return {
        s.labels[label]: s.value
        for family in running.service.metrics.registry.collect()
        if family.name == family_name
        for s in family.samples
        if s.name.endswith("_total") or family.type == "gauge"
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refuse", [False, True], ids=["named", "refused"])
def test_a_learner_pushing_against_the_others_is_named_and_the_honest_are_not(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, refuse: bool
) -> None:
    caplog.set_level(logging.INFO, logger="diloco.coordinator")
    overrides = {**OVERRIDES, "sync.refuse_suspects": refuse, "sync.quorum": 0 if refuse else 1}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        learners, shards = joined(running, first, 2)
        more = learners[1:]
        try:
            hostile = learners[2].worker_id
            refused = push_rounds(running, learners, init, shards, range(ROUNDS))
            all_merged(running, 3 * ROUNDS - len(refused))
            detail = running.service.status_detail()
            assert list(detail["suspect_learners"]) == [hostile], detail["suspect_learners"]
            assert "does not go their way" in detail["suspect_learners"][hostile]
            shown = {w["worker_id"]: w for w in detail["workers"]}
            assert shown[hostile]["delta_alignment"] < 0 < shown[first.worker_id]["delta_alignment"]
            assert all(0.5 < shown[w.worker_id]["delta_norm_ratio"] < 2 for w in learners)
            scraped = samples(running, "diloco_learner_suspect", "worker")
            assert scraped == {first.worker_id: 0.0, more[0].worker_id: 0.0, hostile: 1.0}
            # Named at its 6th cosine (pusher_watch.MIN_WATCHED), its 7th push (its first found no
            # outer momentum yet): from that one on, refused if told to.
            assert refused == (list(range(6, ROUNDS)) if refuse else [])
            assert detail["pushes_refused"] == len(refused)
            assert samples(running, "diloco_pushes_refused", "reason")["its_learner_looks_hostile"] == len(
                refused
            )
        finally:
            for learner in more:
                learner.close()
    named = [
        m for r in caplog.records if (m := r.getMessage()).startswith("learner ") and "looks hostile" in m
    ]
    assert len(named) == 1 and hostile in named[0], named
    assert ("its pushes refused meanwhile" if refuse else "diloco certs revoke") in named[0], named


@pytest.mark.timeout(120)
def test_a_restarted_coordinator_still_names_and_refuses_the_learner(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # Its watch in memory only, a restart gave the learner MIN_WATCHED more pushes, each merged.
    overrides = {**OVERRIDES, "sync.refuse_suspects": True}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        learners, shards = joined(running, first, 2)
        ids = [learner.worker_id for learner in learners]
        try:
            assert push_rounds(running, learners, init, shards, range(ROUNDS)) == [6, 7]
            all_merged(running, 3 * ROUNDS - 2)
            before = {w["worker_id"]: w for w in running.service.status_detail()["workers"]}
        finally:
            config = stopped(running, learners)
    with restarted(config, tmp_path, ids) as (again, back):
        detail = again.service.status_detail()
        assert list(detail["suspect_learners"]) == [ids[2]], detail["suspect_learners"]
        shown = {w["worker_id"]: w for w in detail["workers"]}
        for w in ids:
            assert shown[w]["delta_alignment"] == before[w]["delta_alignment"]
        # Its very next push is refused; the honest learners' are taken.
        assert push_rounds(again, back, init, shards, range(ROUNDS, ROUNDS + 1)) == [ROUNDS]


@pytest.mark.timeout(120)
def test_a_learner_going_against_the_others_own_directions_is_refused_from_its_second_push(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # Each learner's direction its own (coordinator/agreement.py): no momentum needed, so the
    # hostile is named as soon as every learner has MIN_PUSHES (2) pushes.
    with tiny_coordinator(tiny_corpus, tmp_path, DIRECTIONS) as (running, first, init):
        learners, shards = joined(running, first, 2)
        try:
            why = AGAINST
            assert push_rounds(running, learners, init, shards, range(4), why) == [1, 2, 3]
            all_merged(running, 3 * 4 - 3)
            detail = running.service.status_detail()
            hostile = learners[2].worker_id
            assert (
                list(detail["suspect_learners"]) == [hostile] and why in detail["suspect_learners"][hostile]
            )
            shown = {w["worker_id"]: w for w in detail["workers"]}
            assert shown[hostile]["delta_disagreement_largest"] > 1.5  # -0.9 against +0.9 or so
            assert all(shown[w.worker_id]["delta_disagreement_largest"] in (None, 0.0) for w in learners[:2])
        finally:
            for learner in learners[1:]:
                learner.close()


@pytest.mark.timeout(120)
def test_a_learner_named_for_its_direction_stays_named_after_a_restart_while_nothing_tells(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # Directions live in memory: after a restart they are built again. Where the learners' deltas
    # are noise alone, nothing tells them apart, and the naming from before the restart stands.
    why = AGAINST
    with tiny_coordinator(tiny_corpus, tmp_path, DIRECTIONS) as (running, first, init):
        learners, shards = joined(running, first, 2)
        ids = [learner.worker_id for learner in learners]
        try:
            assert push_rounds(running, learners, init, shards, range(3), why) == [1, 2]
            all_merged(running, 3 * 3 - 2)
        finally:
            config = stopped(running, learners)
    with restarted(config, tmp_path, ids) as (again, back):
        assert list(again.service.status_detail()["suspect_learners"]) == [ids[2]]
        rounds = range(3, 3 + MIN_WATCHED + 2)  # past the pushes a restored naming is carried for
        assert push_rounds(again, back, init, shards, rounds, why, shared=0.0) == list(rounds)
