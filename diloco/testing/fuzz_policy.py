"""The fuzzer's world (diloco.testing.fuzz): who calls, what each role may call, the kinds of
pushes, rows and inits it makes, the codes a refusal may carry; and its set-up: certificates for
every identity, the hosts a plaintext coordinator listens on, the coordinator's overrides, the
audit at the end. The policy is issue 14's, written out again here so the guard is checked
against it, not against itself."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from hypothesis import strategies as st

from diloco.security.certs import init_ca, issue
from diloco.security.revocation import revoke
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb

# Codes a refusal may carry. Anything else (UNKNOWN, INTERNAL, ...) is a crash in a handler.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
}  # fmt: skip
IDENTITIES = {
    "learner-a": pb.ROLE_COMPUTE,
    "learner-b": pb.ROLE_COMPUTE,
    "data-a": pb.ROLE_DATA,
    "data-b": pb.ROLE_DATA,
    "stranger": 0,
}
OTHER_HOST = ("learner-b", "data-b", "stranger")  # plaintext with two hosts: these call from ::1
# What is wrong with a push's tensors or header ("valid": nothing), and which rows it names.
PUSH_KINDS = ["valid", "valid", "valid", "nan", "inf", "huge_values", "far", "inflated", "inflated_far",
              "wrong_shape", "wrong_name", "huge_tokens", "unknown_fragment", "stale", "wrong_codec", "empty"]  # fmt: skip
ROWS = ["own", "own", "own_again", "others_held", "others_pushed", "never_leased", "heldout", "corrupt",
        "outside", "none", "all_shards"]  # fmt: skip
INIT_KINDS = ["model", "marked", "unsplittable", "other_model", "huge"]
COUNTERS = [1.0, 0.0, -1.0, math.nan, math.inf, 2.0**60]
# With certificates: each identity's role, and what each role may call (issue 14's policy). The
# namesake is an observer's certificate named like a learner ("learner-a").
CERT_ROLES = {"learner-a": "learner", "learner-b": "learner", "data-a": "data", "data-b": "data",
              "watcher": "observer", "ops": "operator", "namesake": "observer"}  # fmt: skip
CERT_NAME = {"namesake": "learner-a"}
REVOKED = "revoked"  # a learner's certificate from the run's CA, in the coordinator's --tls-crl
ANYONE = {"join", "heartbeat", "leave", "status"}
MAY_CALL = {
    "learner": ANYONE | {"lease_shard", "report_shard", "push", "pull", "init"},
    "data": ANYONE | {"lease_chunk", "complete_chunk", "fail_chunk"},
    "observer": ANYONE,
    "operator": ANYONE | {"finish"},
}
JOINS_AS = {"learner": pb.ROLE_COMPUTE, "data": pb.ROLE_DATA, "observer": pb.ROLE_OBSERVER,
            "operator": pb.ROLE_OBSERVER}  # fmt: skip
JOIN_ROLES = [pb.ROLE_COMPUTE, pb.ROLE_DATA, pb.ROLE_OBSERVER]
# The worker id a call acts as: mostly the caller's own (""), else any other identity's.
ACTING = st.one_of(st.just(""), st.just(""), st.sampled_from(sorted({*IDENTITIES, *CERT_ROLES})))


def own_id(who: str) -> str:
    """The worker id an identity holds as itself (its certificate's name)."""
    return CERT_NAME.get(who, who)


def policy_refusal(
    what: str,
    who: str,
    acting: str,
    joins_as: int | None,
    blank: bool,
    *,
    secure: bool,
    holder: dict[str, str],
    me: str,
    live: Callable[[str], bool],
) -> str:
    """Why the policy forbids this call ("" when it does not): with certificates, by role and
    name; by anyone, acting as a worker another caller holds (a join: while it is live). `holder`:
    who holds each worker id; `me`: the caller as `holder` names it."""
    worker = acting or own_id(who)
    # (A plaintext join without an id is given a fresh one: it acts as nobody's worker.)
    bound = None if blank and not secure else holder.get(worker)
    # (A join, or a leave, of a worker that is not live takes or frees nothing: in plaintext a
    # host's worker goes to another host once it left.)
    if (
        bound is not None
        and bound != me
        and what not in ("status", "finish")
        and (live(worker) or (secure and what == "join") or what not in ("join", "leave"))
    ):
        return "as a worker another caller holds"
    if not secure:
        return ""
    if who == REVOKED:
        return "a certificate revoked (--tls-crl)"
    role = CERT_ROLES.get(who)
    if role is None:
        return "a certificate of another CA"
    if what not in MAY_CALL[role]:
        return f"{what} by {role}"
    if acting and acting != own_id(who):
        return "as another worker than its certificate's"
    if joins_as is not None and joins_as != JOINS_AS[role]:
        return "joins in another role than its certificate's"
    return ""


def holders_of(bound: list[tuple[str, str]]) -> dict[str, str]:
    """Who holds each worker id, from the ledger's (worker, caller) bindings: a host, or the
    identity whose certificate (role, name) the caller names."""
    holder: dict[str, str] = {}
    for worker, caller in bound:
        kind, _, rest = str(caller).partition(":")
        if kind == "host":
            holder[worker] = rest
        else:
            role, _, name = rest.partition(":")
            holder[worker] = next(
                (w for w, r in CERT_ROLES.items() if r == role and CERT_NAME.get(w, w) == name), caller
            )
    return holder


def fuzz_certificates(tmp: Path) -> tuple[dict[str, Security], dict[str, Security]]:
    """Every caller's Security for `make_machine`'s channels (CERT_ROLES, a stranger from another
    CA, and a learner whose certificate is revoked), and for `tiny_coordinator`: the coordinator's
    (checking the CA's revocation list), its data worker's, its learner's."""
    init_ca(tmp / "ca")
    init_ca(tmp / "other-ca")
    mine = {
        who: Security(tls=issue(tmp / "ca", role, CERT_NAME.get(who, who), out=tmp / "certs" / who))
        for who, role in CERT_ROLES.items()
    }
    mine["stranger"] = Security(tls=issue(tmp / "other-ca", "learner", "stranger"))
    mine[REVOKED] = Security(tls=issue(tmp / "ca", "learner", REVOKED, out=tmp / "certs" / REVOKED))
    crl, *_ = revoke(tmp / "ca", mine[REVOKED].tls.cert)
    coordinator = Security(tls=issue(tmp / "ca", "coordinator", "coordinator"), crl=str(crl))
    return mine, {"coordinator": coordinator, "data": mine["data-a"], "learner": mine["learner-a"]}


def has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here: with 127.0.0.1, two hosts without leaving the machine."""
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


def plaintext_hosts() -> tuple[str, bool]:
    """Where a plaintext coordinator for the fuzzer listens, and whether `make_machine` gets two
    hosts: localhost (127.0.0.1 and ::1) where ::1 binds, else 127.0.0.1 alone."""
    two = has_ipv6_loopback()
    return ("localhost" if two else "127.0.0.1"), two


def fuzz_overrides() -> dict[str, object]:
    """The coordinator the fuzzer drives: a short staleness bound (stale pushes are refused
    early), data for many epochs (shards to lease for the whole run), leases and workers that
    outlive the whole run (nothing expires in the middle of a call that must change nothing)."""
    return {"sync.max_staleness": 4, "data.epochs": 50, "coordinator.lease_ttl_s": 3600.0}


def audit_ok(workdir: Path) -> list[str]:
    from diloco.coordinator.audit import audit

    return audit(workdir).violations
