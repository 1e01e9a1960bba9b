"""The merger computes the outer step with the service lock released: the rest of the coordinator
answers meanwhile, and the round it merges stays sealed until its head moves on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from diloco.coordinator import merging
from diloco.v1 import coordinator_pb2 as pb
from tests.support import delta_header, tiny_coordinator


@pytest.mark.timeout(120)
def test_heartbeats_and_the_lock_are_free_while_a_merge_computes(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real_outer_step = merging.outer_step

    def slow_outer_step(*args, **kwargs):  # a fragment that takes as long as the test says to step
        entered.set()
        assert release.wait(30)
        return real_outer_step(*args, **kwargs)

    monkeypatch.setattr(merging, "outer_step", slow_outer_step)
    with tiny_coordinator(tiny_corpus, tmp_path, {"data.epochs": 4}) as (running, learner, init):
        try:
            check_a_merge_in_flight(running.service, learner, init, entered, release)
        finally:
            release.set()  # a failed check must not leave the merger waiting


def check_a_merge_in_flight(
    service, learner, init, entered: threading.Event, release: threading.Event
) -> None:
    """While the outer step waits on `release`: what the rest of the coordinator can do."""
    frag = service.fragments[0]
    delta = {n: torch.full_like(t, 1e-3) for n, t in init.items()}
    assert learner.push(delta_header(learner, "fp32", "first"), delta).accepted
    assert entered.wait(20), "the merge did not start"

    # The lock is free, and a learner's RPC is answered, while the outer step runs.
    assert service.cond.acquire(timeout=2), "the merger held the service lock through the outer step"
    service.cond.release()
    started = time.monotonic()
    learner.heartbeat(pb.HeartbeatRequest(worker_id=learner.worker_id))
    assert time.monotonic() - started < 5
    # The round is still the merger's: not merged, its push still pending (so a finishing run
    # waits for it), and a push to the same fragment waits for the next round.
    assert frag.version == 0 and frag.sealing and [p.push_id for p in frag.pending] == ["first"]
    assert not service.wait_published(timeout_s=0.1)
    second = threading.Thread(
        target=lambda: learner.push(delta_header(learner, "fp32", "second"), delta), daemon=True
    )
    second.start()
    time.sleep(0.3)
    assert [p.push_id for p in frag.pending] == ["first"], "a push joined the round being merged"

    release.set()
    second.join(20)
    assert service.wait_published(timeout_s=20)
    assert frag.version == 2  # the first round, then the second push's own
