"""A learner's running statistics travel as their values, in fp32 whatever the codec, and a merge
overwrites them: never a delta against an older base, a quantized small variance, or a value
shifted by what moved since the push (each once took a global variance below zero)."""

from __future__ import annotations

import torch

from diloco.compute import outer
from diloco.config import SyncConfig
from diloco.wire import codecs

STATS = frozenset({"bn.running_var"})


def test_statistics_go_as_values_and_parameters_as_deltas() -> None:
    base = {"w": torch.tensor([1.0, 1.0]), "bn.running_var": torch.tensor([1.0, 1.0])}
    params = {"w": torch.tensor([0.5, 2.0]), "bn.running_var": torch.tensor([1e-5, 700.0])}
    sent = outer.delta(base, params, ["w", "bn.running_var"], STATS)
    assert torch.equal(sent["w"], torch.tensor([0.5, -1.0])) and torch.equal(
        sent["bn.running_var"], params["bn.running_var"]
    )
    residual: dict[str, torch.Tensor] = {}
    blobs = outer.encode(sent, SyncConfig(codec="int4"), residual, STATS)
    # A layer's variances from 1e-5 to 700 in one int4 block: the small one would be 0.
    exact = codecs.decode(blobs["bn.running_var"].numpy().tobytes(), "fp32", (2,))
    assert torch.equal(exact, params["bn.running_var"]) and "bn.running_var" not in residual


def test_a_merge_overwrites_statistics_however_the_parameters_are_taken() -> None:
    params = {"w": torch.tensor([2.0]), "bn.running_var": torch.tensor([0.9])}
    at_push = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    merged = {"w": torch.tensor([3.0]), "bn.running_var": torch.tensor([0.01])}
    outer.take(params, merged, alpha=0.0, mixing=False, at_push=at_push, exact=STATS)
    assert params["w"].item() == 4.0  # the steps since the push kept on top
    assert torch.equal(params["bn.running_var"], merged["bn.running_var"])  # not 0.01 + 0.9 - 1.0 < 0
