"""What the coordinator reads of a delta to judge which way it points, without reading all of it:
its cosine to the fragment's outer momentum over a sample drawn afresh for every push (the pusher
watch's alignment), and a sketch of it at positions fixed for the coordinator's life and drawn
from its own randomness (a learner's direction against the other learners': agreement.py). A
pusher knows neither where the sample falls nor where the sketch reads.
"""

from __future__ import annotations

import math
import random
import secrets
import threading
from collections.abc import Collection, Mapping

import numpy as np
import torch

# The cosine's sample (alignment): tensors up to SAMPLE_ALL entries whole, larger ones in
# SAMPLE_BLOCKS blocks that together hold 1/SAMPLE_SHARE of them.
SAMPLE_ALL = 1 << 16
SAMPLE_BLOCKS = 4
SAMPLE_SHARE = 8


def alignment(
    delta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    skip: Collection[str] = (),
    rng: random.Random | None = None,
) -> float | None:
    """The cosine between a delta and the fragment's outer momentum, over the tensors of both but
    `skip` (running statistics come as values); None while the momentum is zero (no merge yet).

    Over a sample: of each tensor larger than SAMPLE_ALL entries, SAMPLE_BLOCKS contiguous blocks
    of 1/(SAMPLE_BLOCKS · SAMPLE_SHARE) of it at offsets `rng` draws per push (a pusher cannot
    know which), so the watch reads an eighth of the delta and of the momentum. Over every entry it
    cost 12% of the coordinator's CPU per pushed MB (benchmarks/ingest.py: +0.23 ms/MB on 1.9);
    the sample 0.03 ms/MB (a 49 MB fragment in 1.5 ms), within 0.01 of the whole cosine."""
    rng = rng or random.Random()
    along = delta_sq = momentum_sq = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for name in (n for n in delta if n in momentum and n not in skip):
            d, m = flat_values(delta[name]), flat_values(momentum[name])
            for start, stop in sampled(d.size, rng):
                x, y = d[start:stop], m[start:stop]
                along += float(np.dot(x, y))
                delta_sq += float(np.dot(x, x))
                momentum_sq += float(np.dot(y, y))
    if not (0 < delta_sq < math.inf and 0 < momentum_sq < math.inf and math.isfinite(along)):
        return None
    return along / math.sqrt(delta_sq * momentum_sq)


def flat_values(t: torch.Tensor) -> np.ndarray:
    """A tensor's entries as one flat fp32 array (a view where it already is one). numpy, as
    wire.tensors.sq_norm: torch's reductions start an OpenMP team per gRPC handler thread."""
    flat = t.detach().reshape(-1)
    return (flat if flat.dtype == torch.float32 else flat.float()).numpy()


def sampled(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """The [start, stop) spans of a flat tensor the cosine reads: all of a small one, else
    SAMPLE_BLOCKS blocks at random offsets."""
    if size <= SAMPLE_ALL:
        return [(0, size)]
    block = size // (SAMPLE_BLOCKS * SAMPLE_SHARE)
    return [(s, s + block) for s in (rng.randrange(size - block + 1) for _ in range(SAMPLE_BLOCKS))]


# The sketch (Sketcher): at most SKETCH_ENTRIES entries of a fragment, spread over its tensors by
# their size. A cosine between two sketches of this size stands within ~0.01 of the whole one
# (its error falls as 1/sqrt(entries)); a learner's sketch of each fragment is kept in memory.
SKETCH_ENTRIES = 1 << 15


class Sketcher:
    """The positions a fragment's deltas are sketched at, drawn on the fragment's first delta from
    the coordinator's own randomness and kept for its life: every learner's deltas of a fragment
    are read at the same entries, so that their sketches compare."""

    def __init__(self, entries: int = SKETCH_ENTRIES, seed: int | None = None) -> None:
        self.entries = entries
        self._rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
        self._positions: dict[int, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()  # drawn once, whichever handler thread comes first

    def positions(self, fragment: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Each tensor's sorted positions (of its flat entries): all of a fragment of at most
        `entries`, else a share of each tensor by its size (one at least)."""
        with self._lock:
            if fragment in self._positions:
                return self._positions[fragment]
            total = sum(sizes.values())
            share = min(1.0, self.entries / total) if total else 1.0
            drawn = {}
            for name in sorted(sizes):
                n = sizes[name]
                k = n if share >= 1.0 else min(n, max(1, round(n * share)))
                drawn[name] = np.arange(n) if k == n else np.sort(self._rng.choice(n, k, replace=False))
            self._positions[fragment] = drawn
            return drawn

    def sketch(
        self, fragment: int, delta: Mapping[str, torch.Tensor], skip: Collection[str] = ()
    ) -> np.ndarray | None:
        """The delta's entries at the fragment's positions (every tensor but `skip`), scaled to
        unit length: None where it is zero or not finite, or its tensors are not the fragment's
        first ones."""
        names = {n: t for n, t in delta.items() if n not in skip}
        where = self.positions(fragment, {n: t.numel() for n, t in names.items()})
        if set(where) != set(names) or any(
            where[n].size and where[n][-1] >= t.numel() for n, t in names.items()
        ):
            return None
        got = (
            np.concatenate([flat_values(names[n])[where[n]] for n in sorted(where)]) if where else np.zeros(0)
        )
        with np.errstate(over="ignore", invalid="ignore"):
            norm = float(np.linalg.norm(got))
        if not 0 < norm < math.inf:
            return None
        return (got / norm).astype(np.float32)
