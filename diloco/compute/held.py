"""What a learner holds of each fragment between pushes: its base, version and counters, and the
push in flight. Plain data, so it can be kept on local disk (diloco.compute.local_state) and a
restarted learner can go on from it. The shard rows it trained on are in diloco.compute.rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.v1 import coordinator_pb2 as pb


@dataclass
class HeldFragment:
    """What a learner holds of one fragment."""

    names: list[str]
    version: int = -1
    base: dict[str, torch.Tensor] = field(default_factory=dict)  # Θ_p as last received (CPU fp32)
    steps: int = 0  # inner steps since Θ_p was received
    tokens: int = 0
    loss_sum: float = 0.0
    in_flight: bool = False  # pushed; its merged result has not been applied yet
    apply_at: int = 0  # inner step from which the merged result is applied
    # sync.keep_overlap: θ_p and the counters as they were at the push, so the steps since
    # can be kept on top of the merged result.
    at_push: dict[str, torch.Tensor] = field(default_factory=dict)
    counted_at_push: tuple[int, int, float] = (0, 0, 0.0)
    # The push in flight (header with its push_id, and what it carries): kept on local disk, so a
    # restarted learner can ask about it again (diloco.compute.local_state).
    push: tuple[pb.TensorHeader, dict[str, torch.Tensor]] | None = None
