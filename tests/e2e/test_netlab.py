"""The userspace link emulator (diloco.testing.netlab): a round trip across it takes the configured
RTT, and a bulk transfer moves at most at the configured rate (and not far below it).

Real parts: network namespaces, TUN devices and TCP (needs root, `ip` and /dev/net/tun; skipped
without them). Sockets are opened by short-lived threads that enter a machine's namespace, so
nothing but the emulated link sits between the two ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from diloco.testing.netlab import Link, NetLab, enter_namespace

pytestmark = pytest.mark.e2e

RATE_BPS = 20e6
RTT_S = 0.040
T = TypeVar("T")


@pytest.fixture
def lab() -> Iterator[NetLab]:
    # .ci/run runs as root and installs iproute2: there a missing part is a failure, not a skip.
    give_up = pytest.fail if os.environ.get("CI") else pytest.skip
    if shutil.which("ip") is None or os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        give_up("needs root, the ip command (iproute2) and /dev/net/tun")
    with NetLab({"hub": Link(), "a": Link(RATE_BPS, RTT_S)}) as made:
        yield made


def in_namespace(namespace: str, make: Callable[[], T]) -> T:
    """`make()` run by a thread inside `namespace`: the socket it opens lives there."""
    made: list[T] = []
    thread = threading.Thread(target=lambda: (enter_namespace(namespace), made.append(make())))
    thread.start()
    thread.join(10)
    assert made, f"could not open a socket in {namespace}"
    return made[0]


def connected_pair(lab: NetLab) -> tuple[socket.socket, socket.socket]:
    """(client on machine a, server's end on the hub), TCP across a's link."""
    listener = in_namespace(lab["hub"].namespace, lambda: socket.create_server((lab["hub"].address, 0)))
    client = in_namespace(lab["a"].namespace, socket.socket)
    with listener:
        listener.settimeout(10)
        client.settimeout(10)
        client.connect((lab["hub"].address, listener.getsockname()[1]))
        server, _ = listener.accept()
    server.settimeout(10)
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


def test_a_round_trip_takes_the_links_rtt(lab: NetLab) -> None:
    client, server = connected_pair(lab)
    with client, server:
        trips = []
        for _ in range(8):
            started = time.perf_counter()
            client.sendall(b"x" * 100)
            server.sendall(server.recv(100))
            assert client.recv(100)
            trips.append(time.perf_counter() - started)
    assert min(trips) >= RTT_S, trips
    assert statistics.median(trips) < RTT_S * 1.5, trips


def test_a_bulk_transfer_moves_at_the_links_rate(lab: NetLab) -> None:
    client, server = connected_pair(lab)
    total = int(RATE_BPS / 8 * 1.0)  # ~1 s at the rate
    received: list[tuple[int, float]] = []

    def receive() -> None:
        got, first = 0, 0.0
        while got < total:
            chunk = server.recv(1 << 20)
            if not chunk:
                break
            first = first or time.perf_counter()
            got += len(chunk)
        received.append((got, time.perf_counter() - first))

    with client, server:
        reader = threading.Thread(target=receive)
        reader.start()
        client.sendall(b"\0" * total)
        reader.join(15)
    assert received and received[0][0] == total, received
    rate = total * 8 / received[0][1]
    assert 0.6 * RATE_BPS <= rate <= RATE_BPS * 1.02, f"{rate / 1e6:.1f} Mbit/s through a 20 Mbit/s link"
    assert lab.stats()["a"]["up_bytes"] >= total
