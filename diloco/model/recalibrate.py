"""BatchNorm statistics recomputed for the global model's own weights, before it is evaluated or
exported (what SWA's `torch.optim.swa_utils.update_bn` does).

The coordinator merges running statistics as the mean of the learners' (contract.running_stats):
the statistics of the learners' weights, not of the merged ones. Under an outer step that carries
the weights past their mean (outer lr 0.7, momentum 0.9) the two part: a small ResNet on digits
held out 53-75% with the merged statistics and 98% with statistics recomputed for the same
weights. So wherever the global model is judged or written, its statistics are recomputed on the
run's first train rows (eval.recalibrate_batches batches, the same rows every time); a model
without running statistics reads nothing and is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from diloco.data.shard import concat_columns, read_shard
from diloco.model.contract import column_tensor, normalization_layers

Columns = Mapping[str, np.ndarray]


def recalibrate(
    model: nn.Module,
    *,
    rows: Callable[[], Columns | None],
    batch_size: int,
    batches: int,
    device: torch.device | str = "cpu",
) -> int:
    """Replace the model's running statistics with their cumulative mean over the first `batches`
    batches of `rows()` (forwarded in train mode, without gradients); the rows forwarded. 0, and
    the model untouched: no running statistics, batches 0, or no rows (`rows` is only called when
    there is something to recompute, so a model without BatchNorm reads no shard)."""
    layers = normalization_layers(model)
    if not layers or batches <= 0:
        return 0
    columns = rows()
    n = min(min((len(c) for c in (columns or {}).values()), default=0), batches * batch_size)
    # Whole batches only (a short last one would weigh as much as a full one in the cumulative
    # mean), and never a batch of one row: BatchNorm1d refuses that in train mode.
    n = n - n % batch_size if n >= batch_size else n
    if n < 2:
        return 0
    assert columns is not None
    momenta = [m.momentum for m in layers]
    was_training = model.training
    try:
        for m in layers:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average: every batch weighs the same, none decays
        model.train()
        with torch.no_grad():
            for start in range(0, n, batch_size):
                end = min(start + batch_size, n)
                model({name: column_tensor(c[start:end]).to(device) for name, c in columns.items()})
    finally:
        for m, momentum in zip(layers, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)
    return n


def first_rows(shards: Sequence[Mapping[str, Any]], wanted: int) -> dict[str, np.ndarray] | None:
    """The first `wanted` rows of these shards ({"uri", "checksum", "rows"}), in the order given,
    reading no shard past them; None when there are none."""
    read, total = [], 0
    for s in shards:
        if total >= wanted:
            break
        read.append(read_shard(s["uri"], s.get("checksum")))
        total += int(s["rows"])
    if not read:
        return None
    return {name: c[:wanted] for name, c in concat_columns(read).items()}
