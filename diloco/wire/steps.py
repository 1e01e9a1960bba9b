"""The pull codec: how a published fragment travels to learners, both sides side by side.

With sync.pull_codec = fp32 a learner pulls the fragment whole. Otherwise the coordinator keeps,
per fragment, what learners hold (the `broadcast`: the last value they decoded) and a short chain
of encoded steps between published versions; a learner that holds version v pulls the steps from
v to the latest and adds each to its own copy, which then equals the coordinator's broadcast
exactly (both sides add the same decoded steps). A learner with no version, or one too far back
for the chain, pulls the broadcast whole.
"""

from __future__ import annotations

import torch

from diloco.v1 import coordinator_pb2 as pb
from diloco.wire import codecs

# version -> (the version before it, the encoded blobs of the step between their broadcasts)
Chain = dict[int, tuple[int, dict[str, bytes]]]


# -- the coordinator's side ------------------------------------------------------------------------


def encode_steps(
    params: dict[str, torch.Tensor], broadcast: dict[str, torch.Tensor], codec: str, level: int
) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """The step from what learners hold to `params`, encoded, and what they will hold after it."""
    blobs, held = {}, {}
    for name, theta in params.items():
        blobs[name], held[name] = codecs.encode_step(theta, broadcast[name], codec, level)
    return blobs, held


def steps_since(chain: Chain, latest: int, have: int) -> list[tuple[int, dict[str, bytes]]] | None:
    """The encoded steps from version `have` up to `latest`, oldest first; None when the chain no
    longer reaches back to `have` (the learner pulls the fragment whole)."""
    steps: list[tuple[int, dict[str, bytes]]] = []
    v = latest
    while v > have and v in chain:  # walk the chain back to the version held
        base, blobs = chain[v]
        steps.append((v, blobs))
        v = base
    return list(reversed(steps)) if v == have else None


# -- the learner's side ----------------------------------------------------------------------------


def decode_steps(
    base: dict[str, torch.Tensor],
    held_version: int,
    parts: list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]],
) -> dict[str, torch.Tensor] | None:
    """The merged value from what was sent: the last part when sent whole, else the held base plus
    each encoded step. None when the steps do not start right after the version held."""
    first = parts[0][0]
    if not first.delta:
        return parts[-1][1]
    if first.version != held_version + 1:
        return None
    value = {n: t.clone() for n, t in base.items()}
    for header, blobs in parts:
        for name, blob in blobs.items():
            value[name] += codecs.decode(blob.numpy().tobytes(), header.codec, tuple(value[name].shape))
    return value
