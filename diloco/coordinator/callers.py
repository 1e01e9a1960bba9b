"""Who is calling, and what each caller holds: so that no caller acts as another's worker,
registers workers without bound, or holds every push slot and pull wait.

A caller is its certificate's role and name under mutual TLS (one certificate, one worker id: the
guard already checks that), else the host it calls from. In token mode every holder of the token is
trusted alike, so the host is the only thing that tells two of them apart: fake learners joined
from one machine then share one cap, and one machine cannot act as another machine's worker.
(Behind one NAT every worker shares a host; mutual TLS is the way to tell them apart there.)

Bindings live in memory: after a coordinator restart a worker id is bound again by the first
caller that uses it (the workers re-join at once, see client.py).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from diloco.security.certs import subject_of


def caller_of(context: Any) -> str:
    """The caller of one RPC: `cert:<role>:<name>` under mutual TLS, else `host:<address>`. The
    role is part of it: an observer's certificate named like a live learner once passed as that
    learner (a heartbeat of made-up figures, a Leave that took its leases)."""
    pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
    if pem:
        role, name = _subject(pem)
        return f"cert:{role}:{name}"
    return "host:" + peer_host(context.peer())


@functools.lru_cache(maxsize=1024)
def _subject(pem: bytes) -> tuple[str, str]:
    """(role, name) of a certificate, parsed once per certificate (not per call)."""
    return subject_of(pem)


def peer_host(peer: str) -> str:
    """gRPC's peer string without its port: ipv4:10.0.0.2:5000 -> 10.0.0.2, ipv6:[::1]:5000 -> ::1."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer  # unix sockets and the like: the whole string


class Callers:
    """Worker ids bound to the callers that use them, and each caller's open calls by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}  # worker id -> caller
        self._open: Counter[tuple[str, str]] = Counter()  # (kind, caller) -> calls open

    def join_problem(self, worker_id: str, caller: str, live: Iterable[str], cap: int) -> str:
        """Why `caller` may not join as `worker_id` now ("" when it may; it is then bound to it):
        the id is live under another caller (a worker moved to another host joins once its old
        lease lapses), or the caller has `cap` live workers already (0: no cap)."""
        live = set(live)
        with self._lock:
            owner = self._owner.get(worker_id)
            if owner is not None and owner != caller and worker_id in live:
                return f"worker id {worker_id!r} is live under another caller until its lease lapses"
            mine = sum(1 for w, c in self._owner.items() if c == caller and w in live and w != worker_id)
            if cap and mine >= cap:
                return f"{caller} has {mine} live workers (coordinator.max_workers_per_caller = {cap})"
            self._owner[worker_id] = caller
            return ""

    def acting_problem(self, worker_id: str, caller: str) -> str:
        """Why `caller` may not act as `worker_id` ("" when it may): another caller holds the id.
        An id nobody holds (a coordinator restart forgot it) is bound to its first user."""
        with self._lock:
            owner = self._owner.setdefault(worker_id, caller)
        return "" if owner == caller else f"worker {worker_id!r} belongs to another caller"

    def open(self, kind: str, caller: str, cap: int, total_cap: int = 0) -> str:
        """Count one more open call of `kind` for `caller` ("" when counted), unless the caller
        has `cap` open or everyone together has `total_cap` (0: no cap): why not."""
        with self._lock:
            if cap and self._open[kind, caller] >= cap:
                return f"{caller} has {cap} {kind} calls open already"
            if total_cap and sum(n for (k, _), n in self._open.items() if k == kind) >= total_cap:
                return f"{total_cap} {kind} calls open already"
            self._open[kind, caller] += 1
            return ""

    def close(self, kind: str, caller: str) -> None:
        with self._lock:
            self._open[kind, caller] -= 1
            if self._open[kind, caller] <= 0:
                del self._open[kind, caller]


class RefusalLog:
    """Which refusals to log: the first of a kind in each window, then how many more came. A caller
    without an identity can be refused a thousand times a second, and each refusal once cost a
    log line and a ledger write (14,000 of each in 10 s from four threads)."""

    MAX_KINDS = 1024  # kinds remembered at once (a kind names a worker id: not bounded by itself)

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (window start, refusals not logged)

    def note(self, kind: str, now: float) -> tuple[bool, int]:
        """(log this one?, refusals of this kind not logged in the window before it)."""
        with self._lock:
            started, quiet = self._seen.get(kind, (None, 0))
            if started is not None and now - started < self.window_s:
                self._seen[kind] = (started, quiet + 1)
                return False, 0
            if len(self._seen) >= self.MAX_KINDS:
                self._seen.clear()
            self._seen[kind] = (now, 0)
            return True, quiet
