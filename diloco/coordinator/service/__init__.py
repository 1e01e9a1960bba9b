"""The coordinator's gRPC service: membership, leases, the syncer, checkpoints, status.

State that must survive a crash lives in the ledger (committed before an RPC answers) and in the
checkpoint files; what lives only here is the open round of each fragment (its pushes' tensors)
and merges not yet published, which a crash drops — the ledger then marks those pushes dropped,
and their rows go back to the pool.

Merging and publishing are two steps. A round merges in memory at once (the next merge builds on
it); a publisher thread then writes the fragment's checkpoint and commits the merge in the ledger,
and only then may learners pull it. When merges come faster than the store takes checkpoints,
the publisher writes the newest state once and commits every merge since in one transaction:
merge throughput is then bound by arithmetic, not by the store, and nothing a learner holds was
ever lost by a crash. Decisions (quorum, grace window, merge, outer step, lease expiry) are the pure functions of
syncer.py and leases.py; this module only applies them under one lock.
"""

from __future__ import annotations

from diloco.coordinator.service.chunks import ChunkRPCs
from diloco.coordinator.service.evals import EvalRPCs
from diloco.coordinator.service.membership import MembershipRPCs
from diloco.coordinator.service.merger import Merger
from diloco.coordinator.service.parameters import ParameterRPCs
from diloco.coordinator.service.publisher import Publisher
from diloco.coordinator.service.pushes import PushRPCs
from diloco.coordinator.service.shards import ShardRPCs
from diloco.coordinator.service.state import STREAMED_REQUEST_KINDS, FragmentState
from diloco.coordinator.service.status import StatusRPCs
from diloco.coordinator.service.ticker import Ticker
from diloco.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["STREAMED_REQUEST_KINDS", "CoordinatorService", "FragmentState"]


class CoordinatorService(
    MembershipRPCs,
    ChunkRPCs,
    ShardRPCs,
    ParameterRPCs,
    PushRPCs,
    Merger,
    Publisher,
    Ticker,
    StatusRPCs,
    EvalRPCs,
    pb_grpc.CoordinatorServicer,
):
    """The gRPC servicer: each group of RPCs (and each background thread's job) is a mixin in a
    file of its own, over the shared ServiceBase (state, life cycle, helpers)."""
