"""The learner's background pusher against a coordinator that is not there: it notices at once."""

from __future__ import annotations

import socket
import threading
import time

import torch

from diloco.client import WORKER_OUTAGE_TOLERANCE_S, CoordinatorClient
from diloco.compute.sync_channel import SyncChannel
from diloco.v1 import coordinator_pb2 as pb


def a_port_nobody_listens_on() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_syncer_counts_from_the_first_failed_push_not_the_clients_deadline():
    # The learner's client rides out outages for WORKER_OUTAGE_TOLERANCE_S (600 s). The channel
    # keeps its own retry loop, so the client's must not stack under it: otherwise the channel
    # hears of the outage only after 600 s, and sync.max_unreachable_s (300 s) can never act.
    client = CoordinatorClient(
        f"127.0.0.1:{a_port_nobody_listens_on()}", pb.ROLE_COMPUTE, retry_deadline_s=WORKER_OUTAGE_TOLERANCE_S
    )
    client.worker_id = "learner-0"
    stop = threading.Event()
    channel = SyncChannel(client, stop, pull_wait_s=1.0, held=lambda p: 0)
    channel.start()
    try:
        channel.submit(
            pb.TensorHeader(fragment=0, version=0, push_id="p1", codec="fp32"), {"w": torch.ones(2)}
        )
        deadline = time.monotonic() + 20
        while channel.unreachable_for() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert channel.unreachable_for() > 0, "the channel never heard that the syncer is unreachable"
    finally:
        stop.set()
        client.close()
        channel.join(10)
