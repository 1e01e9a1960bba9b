"""A learner process's entry: rank 0 of a learner (or a learner of one process), a follower rank
of a torchrun group, with the learner's own Prometheus metrics served when asked."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from typing import NoReturn

from diloco.compute import group as ranks
from diloco.compute.learner import Learner
from diloco.compute.overrides import LocalOverrides

log = logging.getLogger("diloco.learner")


def run_learner(
    address: str, overrides: LocalOverrides | None = None, stop: threading.Event | None = None
) -> int:
    group = ranks.Group.from_env()  # under torchrun with N > 1: one rank of an N-rank learner
    code = _run_rank(address, overrides, stop, group)
    if group is not None and not group.leader:
        leave_rank(code)  # rank 0 exits as any learner: its writer and pusher threads finish first
    return code


def leave_rank(code: int) -> NoReturn:
    """A rank whose work is done (a follower told to stop, or a rank that ends in an error line)
    leaves without the interpreter's teardown: gloo's threads can abort it ("terminate called
    without an active exception", SIGABRT), and torchrun then reports a group that finished as
    failed, or its exit code as 134 (seen in CI: rank 1 of a 2-rank learner after "learner done";
    rank 0 refused at join; a supervisor would restart it)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(
    address: str,
    overrides: LocalOverrides | None,
    stop: threading.Event | None,
    group: ranks.Group | None,
) -> int:
    if group is not None and not group.leader:
        o = overrides or LocalOverrides()
        from diloco.compute.follower import run_follower

        return run_follower(group, o.device, o.threads)
    learner = Learner(address, overrides, stop, group)
    port = learner.overrides.metrics_port
    if port is None:
        return learner.run()
    from diloco.observe.worker_metrics import serve_worker_metrics

    def snapshot() -> dict[str, float]:
        p = learner.progress
        return {
            "inner_steps": p.inner_steps, "tokens_trained": p.tokens_trained, "busy_seconds": p.busy_s,
            "data_stall_seconds": p.stall_s, "sync_wait_seconds": p.sync_wait_s,
            "budget_wait_seconds": p.held_back_s,
            "inner_loss": 0.0 if math.isnan(p.last_loss) else p.last_loss,
            "tokens_per_second": p.tokens_per_s(), "mfu": p.mfu(),
        }  # fmt: skip

    server = serve_worker_metrics("learner", port, "127.0.0.1", snapshot, lambda: learner.client.worker_id)
    log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)
    try:
        return learner.run()
    finally:
        server.shutdown()
