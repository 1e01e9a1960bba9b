"""Machines behind slow links on one host: what `tc netem` would give, for a kernel without it.

    with NetLab({"hub": Link(), "a": Link(100e6, 0.04), "b": Link(100e6, 0.04)}) as lab:
        subprocess.run([*lab["a"].exec, "python", "client.py", lab["hub"].address])

Each machine is a network namespace with one TUN device, its address a /32 on it and a route to
the lab's /24 through it. A router thread in the process that made the lab reads every IPv4
packet from every TUN and hands it to the destination's TUN after the sender's uplink and the
receiver's downlink: each direction of a link is a FIFO that serializes packets at the link's
rate, delays them by half its round trip, and drops what its queue (the bandwidth-delay product
plus a few packets) cannot hold, as a router's buffer does. So a machine's round trip to an
unshaped hub is its link's RTT, and to another shaped machine the sum of both.

The TUNs carry 64 KB packets (MTU 65000): a 1500-byte MTU at 1 Gbit/s is ~80,000 packets a second,
more than a Python router keeps up with on shared cores. So a new connection's first window is one
packet (route initcwnd 1: 64 KB where Linux sends 10 x 1460 B) and slow start reaches a link's
bandwidth-delay product a round trip or two sooner than on a real WAN. Not modelled: loss beyond
queue overflow, jitter, reordering, and the router's own CPU (it shares the host's cores with
whatever runs in the machines; under load it adds delay).

Needs root (namespaces, /dev/net/tun); everything made is removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import itertools
import os
import selectors
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field

MTU = 65000
SUBNET = "10.77.0"  # private to the lab's namespaces: the host's own routes never see it
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000
# The sockets' buffers may hold a whole bandwidth-delay product (1 Gbit/s x 100 ms = 12.5 MB), as
# a host tuned for a long fat link has; the default write buffer (4 MB) would cap the rate instead.
_TCP_MEM = "4096 131072 33554432"
_labs = itertools.count()


@dataclass(frozen=True)
class Link:
    """A machine's link to the switch: its rate each way (None: unshaped) and its round trip."""

    rate_bps: float | None = None
    rtt_s: float = 0.0


@dataclass(frozen=True)
class Machine:
    name: str
    namespace: str
    device: str  # the TUN inside the namespace: GLOO_SOCKET_IFNAME for ranks there
    address: str

    @property
    def exec(self) -> list[str]:
        """A command prefix that runs a command on this machine."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass
class _Pipe:
    """One direction of a link: a FIFO that serializes at `rate_bps` then delays by `delay_s`."""

    rate_bps: float | None
    delay_s: float
    limit_bytes: float
    busy_until: float = 0.0
    bytes: int = 0
    dropped: int = 0

    def admit(self, now: float, size: int) -> float | None:
        """When the packet leaves the far end, or None when the queue is full (dropped)."""
        if self.rate_bps is None:
            self.bytes += size
            return now + self.delay_s
        backlog = max(0.0, self.busy_until - now) * self.rate_bps / 8
        if backlog + size > self.limit_bytes:
            self.dropped += 1
            return None
        self.busy_until = max(now, self.busy_until) + size * 8 / self.rate_bps
        self.bytes += size
        return self.busy_until + self.delay_s


def _pipe(link: Link) -> _Pipe:
    rate = link.rate_bps
    limit = (rate / 8 * link.rtt_s if rate else 0.0) + 4 * 65536
    return _Pipe(rate, link.rtt_s / 2, limit)


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into a lab's namespace: the sockets it opens from now on are there
    (a DDP rank calls it before its process group starts; Python 3.11 has no os.setns)."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class NetLab:
    """The machines named in `links` (at most 250), each behind its link; a context manager."""

    links: dict[str, Link]
    machines: dict[str, Machine] = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict)
    _up: dict[str, _Pipe] = field(default_factory=dict)
    _down: dict[str, _Pipe] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _wake: tuple[int, int] | None = None
    _tag: str = ""

    def __post_init__(self) -> None:
        self._tag = f"{os.getpid():x}{next(_labs) % 16:x}"  # two labs on one host do not collide

    def __getitem__(self, name: str) -> Machine:
        return self.machines[name]

    def namespace(self, name: str) -> str:
        """The namespace of the machine `name` (a template too: namespace("w{i}"))."""
        return f"dlab{self._tag}-{name}"

    def __enter__(self) -> NetLab:
        try:
            for i, (name, link) in enumerate(self.links.items()):
                m = Machine(name, self.namespace(name), f"dl{self._tag}t{i}", f"{SUBNET}.{i + 1}")
                self._add(m, link)
            self._wake = os.pipe()
            self._thread = threading.Thread(target=self._route, name="netlab-router", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, m: Machine, link: Link) -> None:
        # The TUN is made here, in the root namespace, then moved: its fd stays ours, so the
        # router reads every machine's packets without a helper process in each namespace.
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        self._fds[m.name] = fd
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", m.device.encode(), _IFF_TUN | _IFF_NO_PI))
        self.machines[m.name] = m  # from here close() removes the namespace
        _ip("netns", "add", m.namespace)
        _ip("link", "set", m.device, "netns", m.namespace)
        _ip("-n", m.namespace, "link", "set", "lo", "up")
        _ip("-n", m.namespace, "link", "set", m.device, "mtu", str(MTU), "up")
        _ip("-n", m.namespace, "addr", "add", f"{m.address}/32", "dev", m.device)
        _ip("-n", m.namespace, "route", "add", f"{SUBNET}.0/24", "dev", m.device, "src", m.address,
            "initcwnd", "1")  # fmt: skip
        subprocess.run(
            [*m.exec, "sysctl", "-q", "-w", f"net.ipv4.tcp_rmem={_TCP_MEM}", f"net.ipv4.tcp_wmem={_TCP_MEM}",
             "net.ipv6.conf.all.disable_ipv6=1"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip
        self._up[m.name], self._down[m.name] = _pipe(link), _pipe(link)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per machine: bytes sent and received over its link, packets its queues dropped."""
        return {
            n: {"up_bytes": self._up[n].bytes, "down_bytes": self._down[n].bytes,
                "dropped": self._up[n].dropped + self._down[n].dropped}
            for n in self._up
        }  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in [*self._fds.values(), *(self._wake or ())]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._wake = None
        for m in self.machines.values():  # the TUN inside goes with its namespace
            subprocess.run(["ip", "netns", "del", m.namespace], capture_output=True, timeout=10)

    # -- the router -----------------------------------------------------------------------------

    def _route(self) -> None:
        # Ahead of the machines' own work (a real link's hardware does not wait for the hosts'
        # CPUs), but no higher than the process that made the lab was started at.
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(-20, os.getpriority(os.PRIO_PROCESS, tid) - 10))
        assert self._wake is not None
        by_address = {bytes(map(int, m.address.split("."))): n for n, m in self.machines.items()}
        sel = selectors.DefaultSelector()
        for name, fd in self._fds.items():
            sel.register(fd, selectors.EVENT_READ, name)
        sel.register(self._wake[0], selectors.EVENT_READ, None)
        # (due, seq, packet, destination, whether it still has the downlink to cross)
        events: list[tuple[float, int, bytes, str, bool]] = []
        seq = itertools.count()

        def hop(due: float | None, packet: bytes, dst: str, down: bool) -> None:
            if due is not None:
                heapq.heappush(events, (due, next(seq), packet, dst, down))

        while not self._stop.is_set():
            timeout = max(0.0, events[0][0] - time.monotonic()) if events else None
            for key, _ in sel.select(timeout):
                if key.data is None:
                    return
                src: str = key.data
                while packet := self._read(key.fd):
                    dst = by_address.get(packet[16:20]) if packet[0] >> 4 == 4 else None
                    if dst is not None:  # anything else (not IPv4, not the lab's) goes nowhere
                        hop(self._up[src].admit(time.monotonic(), len(packet)), packet, dst, True)
            now = time.monotonic()
            while events and events[0][0] <= now:
                _, _, packet, dst, down = heapq.heappop(events)
                if down:  # off the sender's uplink, onto the receiver's downlink
                    hop(self._down[dst].admit(now, len(packet)), packet, dst, False)
                else:
                    with contextlib.suppress(OSError):  # a write that fails is a lost packet
                        os.write(self._fds[dst], packet)

    @staticmethod
    def _read(fd: int) -> bytes:
        try:
            return os.read(fd, MTU + 1024)
        except (BlockingIOError, OSError):
            return b""
