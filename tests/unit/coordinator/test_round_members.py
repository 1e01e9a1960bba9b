"""A round's merge is its members' share of the work: a learner that was live when the round's first
delta came, and leaves before it closes, still counts (a real coordinator, two learners)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diloco.client import CoordinatorClient
from diloco.v1 import coordinator_pb2 as pb
from tests.support import PLAIN_OUTER_STEP, delta_header, moved, tiny_coordinator, uniform_delta


@pytest.mark.timeout(120)
def test_a_learner_leaving_mid_round_does_not_make_the_others_push_a_whole_step(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # A merge moves the model by its outer gradient. Quorum 0 (every live learner): the round waits
    # for the second learner until it leaves.
    overrides = {**PLAIN_OUTER_STEP, "sync.quorum": 0}
    with tiny_coordinator(tiny_corpus, tmp_path, overrides) as (running, first, init):
        frag = running.service.fragments[0]
        second = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        second.join()
        delta, whole = uniform_delta(init)
        before = {n: t.clone() for n, t in frag.params.items()}
        assert first.push(delta_header(first, "fp32", "first"), delta).accepted
        time.sleep(0.3)
        assert frag.version == 0, "the round closed without the second learner"
        second.leave("run finishing")
        deadline = time.monotonic() + 20
        while frag.version < 1:
            assert time.monotonic() < deadline, "the round did not close when the second learner left"
            time.sleep(0.02)
        second.close()
        # One of the round's two members pushed: half a step (it was a whole step before, since
        # the leaver no longer counted as live when the round closed).
        assert moved(before, frag.params) == pytest.approx(0.5 * whole, rel=1e-4)
