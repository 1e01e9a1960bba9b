"""Split a model's parameters into P fragments (Streaming DiLoCo).

Both the learner and the coordinator call this on the same (name, size) list, so they agree on
which tensor belongs to which fragment without sending the plan over the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

# Token embeddings and the output head are touched by every token, unlike any one block: they go
# in a fragment of their own so that fragment's sync cadence does not drag the blocks along.
EMBEDDING_MARKERS = ("wte", "wpe", "embed", "lm_head")


def is_embedding(name: str) -> bool:
    return any(marker in name for marker in EMBEDDING_MARKERS)


def assign_fragments(tensors: Sequence[tuple[str, int]], num_fragments: int) -> list[list[str]]:
    """Balanced greedy bin-packing of tensor sizes into `num_fragments` lists of names.

    With P = 1 every tensor is in fragment 0. With P >= 2 embeddings and head take fragment 0 and
    the other tensors are packed, largest first, into the lightest of fragments 1..P-1. The order
    of names inside a fragment follows the model's order, so both sides stream tensors alike.
    """
    if num_fragments < 1:
        raise ValueError("num_fragments must be >= 1")
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    if num_fragments == 1:
        return [names]
    embeddings = [(n, s) for n, s in tensors if is_embedding(n)]
    rest = [(n, s) for n, s in tensors if not is_embedding(n)]
    if not embeddings:
        bins_for_rest = num_fragments
        assignment: dict[str, int] = {}
        offset = 0
    else:
        bins_for_rest = num_fragments - 1
        assignment = {n: 0 for n, _ in embeddings}
        offset = 1
    if len(rest) < bins_for_rest:
        raise ValueError(f"cannot split {len(rest)} non-embedding tensors into {bins_for_rest} fragments")
    loads = [0] * bins_for_rest
    for name, size in sorted(rest, key=lambda t: (-t[1], names.index(t[0]))):
        lightest = min(range(bins_for_rest), key=lambda b: (loads[b], b))
        loads[lightest] += size
        assignment[name] = lightest + offset
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in names:
        fragments[assignment[name]].append(name)
    return fragments
