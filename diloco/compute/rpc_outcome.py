"""What a failed call to the coordinator means for the learner's sync loops: try again, take it
as a refusal of this one push, or give up.

One decision for the pusher and the puller, so they cannot disagree on whether the coordinator
is there (sync.max_unreachable_s counts only when it is not) or on which refusals are for good.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from diloco.security.revocation import REVOKED

IDENTITY_HINT = "check --tls-cert/--token-file"
# A certificate in the coordinator's --tls-crl: no flag of ours mends that.
REVOKED_HINT = "the run's operator revoked this certificate: only a new one (diloco certs issue) is let in"


class Action(enum.Enum):
    RETRY = "retry"  # the same call may succeed later
    MALFORMED = "malformed"  # this request is refused as it is: sending it again cannot help
    FATAL = "fatal"  # the coordinator refuses this learner (or the call) for good


@dataclass(frozen=True)
class Outcome:
    action: Action
    # Whether the coordinator answered. A refusal is an answer: only silence (or a cut link)
    # counts toward sync.max_unreachable_s, which blocks the learner until the coordinator is back.
    reachable: bool
    reason: str


def rpc_outcome(code: grpc.StatusCode, details: str = "") -> Outcome:
    """The decision for a call that failed with `code` (and the coordinator's `details`)."""
    said = details or code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Outcome(Action.RETRY, False, f"the coordinator is unreachable ({code.name})")
    if code == grpc.StatusCode.CANCELLED:
        # The coordinator cancels a stream that stalls (push_idle_s, push_min_bytes_per_s): the
        # link is too slow to carry it, which is an outage to the learner, not an answer.
        return Outcome(Action.RETRY, False, f"the stream was cut: {said}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Push slots, a caller's open pushes or the waiting pulls are full: come back shortly.
        return Outcome(Action.RETRY, True, f"the coordinator is busy: {said}")
    if code == grpc.StatusCode.NOT_FOUND:
        # "unknown worker: join first" (a restart forgot us). The client joins again inside each
        # call (CoordinatorClient._retry), so the next try is made as a joined worker.
        return Outcome(Action.RETRY, True, f"the coordinator does not know this learner: {said}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        # "no parameters yet": a coordinator started without its state waits for a learner to
        # initialize them (any learner's join does); the run, not this learner, is at fault.
        return Outcome(Action.RETRY, True, f"the coordinator is not ready: {said}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Outcome(Action.MALFORMED, True, f"refused as malformed: {said}")
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        # This learner's identity is refused (a rotated token or certificate, another caller
        # holding its worker id): every call it makes will be, however long it tries.
        hint = REVOKED_HINT if REVOKED in said else IDENTITY_HINT
        return Outcome(Action.FATAL, True, f"{said}; {hint}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        # Not a diloco coordinator of this version on that address: no retry changes that.
        return Outcome(Action.FATAL, True, f"{said}: is it a coordinator of the same diloco version?")
    # UNKNOWN, INTERNAL (a handler that failed) and codes the coordinator never sends: it
    # answered, and the next try may land, as before this decision was written down.
    return Outcome(Action.RETRY, True, f"the call failed: {code.name}: {said}")
