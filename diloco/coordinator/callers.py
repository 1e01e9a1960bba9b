"""Who is calling, and what each caller holds: so that no caller acts as another's worker,
registers workers without bound, or holds every push slot and pull wait.

A caller is its certificate's role and name under mutual TLS, else the host it calls from. Under
mutual TLS one certificate is one worker: its worker id is the certificate's name (a join without
an id takes it; any other id is refused), and its role must fit the worker's (an observer's
certificate never acts as a learner or a data worker). In token mode every holder of the token is
trusted alike, so the host is the only thing that tells two of them apart: fake learners joined
from one machine then share one cap (`coordinator.max_workers_per_caller`), and one machine
cannot act as another machine's worker. (Behind one NAT every worker shares a host; mutual TLS is
the way to tell them apart there.)

Bindings (which caller joined each worker id) live in the ledger's workers table, so a restarted
coordinator still knows them: no one takes a worker id by being first to call after a restart. A
binding to a certificate is for the run; one to a host, and its role, move to another host once
its worker has left or its lease has lapsed (a worker moved to another machine). A ledger from before bindings were kept has
none: each such id goes to its first caller whose role fits it.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from diloco.plugins import a_or_an
from diloco.security.certs import subject_of
from diloco.security.guard import JOIN_ROLE
from diloco.v1 import coordinator_pb2 as pb

# The certificate roles that may hold a worker of each role: the guard's rule at join, by the
# worker role's name as the ledger keeps it ("compute", "data", "evaluator", "observer").
CERT_ROLES_OF_WORKER = {
    pb.Role.Name(r).removeprefix("ROLE_").lower(): roles for r, roles in JOIN_ROLE.items()
}


def caller_of(context: Any) -> str:
    """The caller of one RPC: `cert:<role>:<name>` under mutual TLS, else `host:<address>`. The
    role is part of it: an observer's certificate named like a live learner once passed as that
    learner (a heartbeat of made-up figures, a Leave that took its leases)."""
    pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
    if pem:
        return cert_caller(*_subject(pem))
    return "host:" + peer_host(context.peer())


def cert_caller(role: str, name: str) -> str:
    """The caller a certificate of `role` and `name` is (caller_of)."""
    return f"cert:{role}:{name}"


@functools.lru_cache(maxsize=1024)
def _subject(pem: bytes) -> tuple[str, str]:
    """(role, name) of a certificate, parsed once per certificate (not per call)."""
    return subject_of(pem)


def certificate_of(caller: str) -> tuple[str, str] | None:
    """(role, name) of a caller under mutual TLS; None for one told apart by its host."""
    if not caller.startswith("cert:"):
        return None
    role, _, name = caller.removeprefix("cert:").partition(":")  # a role holds no colon; a name may
    return role, name


def peer_host(peer: str) -> str:
    """gRPC's peer string without its port: ipv4:10.0.0.2:5000 -> 10.0.0.2, ipv6:[::1]:5000 -> ::1."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer  # unix sockets and the like: the whole string


def own_worker_id(caller: str) -> str:
    """The one worker id a caller may hold, when it has one: under mutual TLS its certificate's
    name (one certificate, one worker); "" for a caller told apart by its host, which may hold up
    to its cap of workers under ids of its choosing."""
    cert = certificate_of(caller)
    return cert[1] if cert else ""


@dataclass(frozen=True)
class Binding:
    """A worker id as the ledger holds it: its role, the caller that joined it ("" in a ledger
    from before bindings were kept), and whether it is live (active, heard within the lease TTL)."""

    role: str
    caller: str
    live: bool


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused, and with which status (RESOURCE_EXHAUSTED: clients retry)."""

    code: grpc.StatusCode
    why: str


def role_problem(worker_id: str, worker_role: str, caller: str) -> str:
    """Why `caller` may not hold the `worker_role` worker `worker_id` by its certificate's role ("" when
    it may, and always for a caller without a certificate)."""
    cert = certificate_of(caller)
    if cert is None or cert[0] in CERT_ROLES_OF_WORKER.get(worker_role, ()):
        return ""
    holder = f"{a_or_an(cert[0])} certificate" if cert[0] else "a certificate without a role"
    return f"{holder} may not hold the {worker_role} worker {worker_id!r}"


def join_refusal(
    worker_id: str, role: str, caller: str, bound: Binding | None, mine: int, cap: int
) -> Refusal | None:
    """Whether `caller` may join as `worker_id` in `role` (None: it may). `bound`: the id as the
    ledger holds it (None: a new id); `mine`: the caller's other live workers; `cap`:
    coordinator.max_workers_per_caller (0: no cap).

    An id bound to a certificate is that certificate's for the run, in the role it first joined
    with. One bound to a host goes to another caller, in any role, once its worker has left or its
    lease has lapsed (a worker moved to another machine): a token holder that once joined a
    learner's id as an observer, and left, locked that learner out for the run. A restarted worker
    joins again under its id at once, even while its old life still looks live: it is the same
    caller."""
    denied = grpc.StatusCode.PERMISSION_DENIED
    if why := role_problem(worker_id, role, caller):
        return Refusal(denied, why)
    role_fixed = bound is not None and (
        certificate_of(bound.caller) or (bound.live and bound.caller in ("", caller))
    )
    if bound is not None and bound.role != role and role_fixed:
        return Refusal(
            denied, f"worker id {worker_id!r} is a {bound.role} worker's: it cannot join as {role}"
        )
    if bound is not None and bound.caller and bound.caller != caller:
        if certificate_of(bound.caller) and certificate_of(caller):
            return Refusal(denied, f"worker id {worker_id!r} belongs to another certificate")
        if bound.live:
            return Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker id {worker_id!r} is live under another caller until its lease lapses",
            )
    if cap and mine >= cap:
        return Refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{caller} has {mine} live workers (coordinator.max_workers_per_caller = {cap})",
        )
    return None


def acting_problem(worker_id: str, caller: str, bound: Binding | None) -> str:
    """Why `caller` may not act as `worker_id` ("" when it may): its certificate's role does not
    fit the worker's, or another caller joined it. An id without a binding (a ledger from before
    they were kept) is anyone's whose role fits: the caller then binds it (Callers.acting_problem)."""
    if bound is None:
        return ""  # not a worker: the handler's own check says so (join first)
    if bound.caller and bound.caller != caller:
        return f"worker {worker_id!r} belongs to another caller"
    return role_problem(worker_id, bound.role, caller)


# Joins of worker ids new to the run, per caller: a burst (a host starting its workers, up to
# coordinator.max_workers_per_caller at once) then one per NEW_ID_EVERY_S. Leave frees a live
# slot at once, so the live cap alone let one host join and leave 238 fresh ids a second, each a
# row the ledger keeps (805 B: 16 GB a day). Refused with RESOURCE_EXHAUSTED: clients retry.
NEW_ID_BURST = 128
NEW_ID_EVERY_S = 5.0
# Heartbeats per worker: a worker beats every coordinator.heartbeat_s, and a learner also on
# every push it waits on and while it waits for budget (compute/heartbeats.py, ALLOWANCE_ASK_S:
# twice a second) and once at its end. Faster than this, a heartbeat is answered from the last
# one's reply without a ledger write (580 a second from one learner each overwrote its stats).
HEARTBEAT_BURST = 8
HEARTBEATS_PER_INTERVAL = 4
HEARTBEATS_PER_S_AT_LEAST = 4.0


@dataclass(frozen=True)
class Bucket:
    """A token bucket: the calls its key may make (`level`), as of `at`."""

    level: float
    at: float


def spend(bucket: Bucket | None, now: float, per_s: float, burst: float) -> tuple[Bucket, str]:
    """One call against `bucket` (None: a key not seen, full), refilled at `per_s` up to `burst`:
    (the bucket after, "" when the call may go on, else why not)."""
    level = burst if bucket is None else min(burst, bucket.level + max(0.0, now - bucket.at) * per_s)
    if level < 1.0:
        return Bucket(level, now), f"more than {burst:g} at once and {per_s:g} a second after"
    return Bucket(level - 1.0, now), ""


def heartbeat_rate(heartbeat_s: float) -> float:
    """Heartbeats a second one worker may send before they are answered without the work."""
    return max(HEARTBEATS_PER_INTERVAL / heartbeat_s, HEARTBEATS_PER_S_AT_LEAST)


class Rates:
    """Token buckets by key (a caller, a worker id), thread-safe and bounded in number."""

    MAX_KEYS = 4096

    def __init__(self, per_s: float, burst: float) -> None:
        self.per_s, self.burst = per_s, burst
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket] = {}

    def take(self, key: str, now: float) -> str:
        """One call of `key` now: "" when it may go on, else why not (nothing spent then)."""
        with self._lock:
            bucket, why = spend(self._buckets.get(key), now, self.per_s, self.burst)
            if why:
                return why
            if key not in self._buckets and len(self._buckets) >= self.MAX_KEYS:
                self._forget_full(now)
            self._buckets[key] = bucket
            return ""

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets refilled by now (as good as unseen); all of them if none is."""
        full = [
            k
            for k, b in self._buckets.items()
            if spend(b, now, self.per_s, self.burst)[0].level >= self.burst - 1
        ]
        for k in full or list(self._buckets):
            del self._buckets[k]


class WorkerBindings(Protocol):
    """Where bindings are kept: the ledger's workers table (ledger/workers.py)."""

    def binding(self, worker_id: str, ttl_s: float = 0.0) -> tuple[str, str, bool] | None: ...
    def bind_caller(self, worker_id: str, caller: str) -> None: ...
    def live_workers_of(self, caller: str, ttl_s: float) -> list[str]: ...
    def join(self, worker_id: str, role: str, host: str, caller: str | None = None) -> None: ...
    def clock(self) -> float: ...


class Callers:
    """Worker ids bound to the callers that joined them (kept in the ledger), and each caller's
    open calls by kind (in memory: they end with the process)."""

    def __init__(self, ledger: WorkerBindings) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()  # one join (or first binding) decided and written at a time
        self._open_lock = threading.Lock()  # (apart: a push never waits on a join's commit)
        self._open: Counter[tuple[str, str]] = Counter()  # (kind, caller) -> calls open
        self.new_ids = Rates(1.0 / NEW_ID_EVERY_S, NEW_ID_BURST)  # joins of ids new to the run, by caller

    def bound(self, worker_id: str, ttl_s: float = 0.0) -> Binding | None:
        found = self.ledger.binding(worker_id, ttl_s)
        return None if found is None else Binding(*found)

    def join(
        self, worker_id: str, role: str, host: str, caller: str, cap: int, ttl_s: float
    ) -> Refusal | None:
        """Join `caller` as `worker_id` (the ledger's row, with its binding) unless refused
        (join_refusal): decided and written under one lock, so two joins of one id cannot both pass."""
        with self._lock:
            mine = sum(1 for w in self.ledger.live_workers_of(caller, ttl_s) if w != worker_id)
            bound = self.bound(worker_id, ttl_s)
            if refusal := join_refusal(worker_id, role, caller, bound, mine, cap):
                return refusal
            if bound is None and (why := self.new_ids.take(caller, self.ledger.clock())):
                return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{caller} joins new worker ids {why}")
            self.ledger.join(worker_id, role, host, caller)
        return None

    def acting_problem(self, worker_id: str, caller: str) -> str:
        """Why `caller` may not act as `worker_id` ("" when it may: see acting_problem). An id
        without a binding is bound to its first caller whose role fits."""
        bound = self.bound(worker_id)
        if bound is None or bound.caller:
            return acting_problem(worker_id, caller, bound)
        with self._lock:  # the first caller binds it, once
            bound = self.bound(worker_id)
            why = acting_problem(worker_id, caller, bound)
            if not why and bound is not None and not bound.caller:
                self.ledger.bind_caller(worker_id, caller)
            return why

    def open(self, kind: str, caller: str, cap: int, total_cap: int = 0) -> str:
        """Count one more open call of `kind` for `caller` ("" when counted), unless the caller
        has `cap` open or everyone together has `total_cap` (0: no cap): why not."""
        with self._open_lock:
            if cap and self._open[kind, caller] >= cap:
                return f"{caller} has {cap} {kind} calls open already"
            if total_cap and sum(n for (k, _), n in self._open.items() if k == kind) >= total_cap:
                return f"{total_cap} {kind} calls open already"
            self._open[kind, caller] += 1
            return ""

    def close(self, kind: str, caller: str) -> None:
        with self._open_lock:
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
