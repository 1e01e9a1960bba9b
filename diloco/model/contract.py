"""What diloco asks of a model, the user's or its own: one convention, checked where it is used.

    model = factory(**model.kwargs)         an nn.Module (vocab_size and seq_len offered by name)
    out = model(batch)                      batch: {column name: tensor}, one row per sample;
                                            integer columns come as int64
    loss = out | out.loss | out["loss"]     a scalar tensor (Hugging Face models return .loss)
    metrics = out.metrics | out["metrics"]  optional {name: scalar}, e.g. accuracy, averaged
                                            over the held-out rows like the loss

Optionally `model.logits(input_ids)` -> (B, T, vocab) makes a token model sample text.
The coordinator never sees any of this: only named tensors, those of `named_parameters()` and the
running statistics of normalization layers (synced_tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from diloco.errors import DilocoError


class ModelContractError(DilocoError):
    """A model that does not keep the convention: a forward without a loss, a factory without a module."""


def column_tensor(column: np.ndarray) -> torch.Tensor:
    """A batch's slice of a shard column as the model gets it: integers widened to int64 (what
    embeddings and losses index with), floats and booleans as stored. One batch at a time: a
    whole shard widened at once would take 4x its memory."""
    if column.dtype.kind in "iu":
        return torch.from_numpy(column.astype(np.int64))
    return torch.from_numpy(np.ascontiguousarray(column))


def loss_and_metrics(output: Any, where: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (a scalar tensor) and the metrics a forward returned; `where` names the model."""
    if isinstance(output, torch.Tensor):
        loss, metrics = output, None
    elif isinstance(output, Mapping):
        loss, metrics = output.get("loss"), output.get("metrics")
    else:
        loss, metrics = getattr(output, "loss", None), getattr(output, "metrics", None)
    if isinstance(loss, torch.Tensor) and loss.numel() != 1 and loss is not output:
        raise ModelContractError(
            f"{where}: forward's loss has shape {tuple(loss.shape)}, not a scalar: reduce it over the "
            "batch (a mean, as reduction='mean' does)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelContractError(
            f"{where}: forward returned {_kind(output)}, not a scalar loss tensor "
            "(return the loss, an object with .loss, or a dict with 'loss')"
        )
    if metrics is None:
        return loss.reshape(()), {}
    if not isinstance(metrics, Mapping):
        raise ModelContractError(f"{where}: metrics must be a dict of scalars, got {_kind(metrics)}")
    return loss.reshape(()), {str(k): _scalar_metric(k, v, where) for k, v in metrics.items()}


def _scalar_metric(name: object, value: Any, where: str) -> torch.Tensor:
    """One metric as a detached scalar; a per-sample metric is named, not a reshape error."""
    try:
        metric = torch.as_tensor(value).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ModelContractError(f"{where}: metric {name!r} is not a number ({_kind(value)}: {e})") from e
    if metric.numel() != 1:
        raise ModelContractError(
            f"{where}: metric {name!r} has shape {tuple(metric.shape)}, not a scalar: reduce it over "
            "the batch (e.g. (pred == y).float().mean())"
        )
    return metric.reshape(())


# The buffers of a normalization layer that training changes and evaluation reads.
RUNNING_STATS = ("running_mean", "running_var")


def normalization_layers(model: nn.Module) -> list[nn.modules.batchnorm._NormBase]:
    """The model's layers that keep running statistics (BatchNorm and InstanceNorm that track them)."""
    return [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    ]


def running_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """The running statistics of the model's normalization layers (BatchNorm's mean and variance),
    by their names in `named_buffers()`: learners push them with the parameters and the coordinator
    merges them as a plain mean (they are averages themselves: the outer step's momentum would
    overshoot a variance below zero). That mean is the learners' statistics, not the merged
    weights': it is where a learner's own BatchNorm starts again after a merge, and wherever the
    global model is evaluated or exported they are recomputed for its weights (recalibrate).
    num_batches_tracked stays each learner's (it matters only with momentum=None)."""
    layers = {id(m) for m in normalization_layers(model)}
    owners = {name for name, m in model.named_modules() if id(m) in layers}
    stats = {}
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if owner in owners and leaf in RUNNING_STATS and buffer is not None and buffer.is_floating_point():
            stats[name] = buffer
    return stats


def is_running_stat(name: str) -> bool:
    """Whether a tensor's name is a running statistic's (`<module>.running_mean` or `.running_var`,
    as running_stats names them): the name decides what the coordinator merges as a plain mean,
    not what the learner that offers the init says."""
    return name.rpartition(".")[2] in RUNNING_STATS


def averaged_marks_problem(marks: Mapping[str, bool]) -> str:
    """Why these `averaged` marks (tensor name -> marked) cannot be a model's ("" when they can): a
    tensor is marked exactly when its name is a running statistic's. Both ways are refused. A
    parameter marked averaged skips the outlier check and the outer step (the first learner once
    marked every parameter so, and a push of 1e15 replaced them); a statistic left unmarked takes
    the outer step's momentum on the values learners push for it (running_stats), which drives a
    variance below zero. A model's parameter named like a statistic is refused too: rename it."""
    marked = sorted(n for n, averaged in marks.items() if averaged and not is_running_stat(n))
    unmarked = sorted(n for n, averaged in marks.items() if not averaged and is_running_stat(n))
    if marked:
        return (
            f"{len(marked)} tensor(s) marked as running statistics are not named as one "
            f"(<module>.{' or .'.join(RUNNING_STATS)}): {marked[:3]}"
        )
    if unmarked:
        return f"{len(unmarked)} running statistic(s) not marked averaged: {unmarked[:3]}"
    return ""


def synced_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor that travels: the parameters, then the running statistics (running_stats)."""
    return {**dict(model.named_parameters()), **running_stats(model)}


def group_running_stats_problem(model: nn.Module, factory: str) -> str | None:
    """Why a learner of several ranks cannot train this model, or None: each rank keeps its own
    running statistics (DDP takes rank 0's at every forward, FSDP none), so the ones a group
    pushes would be one rank's batches only; not kept in step yet."""
    if not (stats := running_stats(model)):
        return None
    shown = ", ".join(sorted({n.rpartition(".")[0] for n in stats})[:3])
    return (
        f"model.factory {factory}: {shown} keep running statistics, which a learner of several ranks "
        "(--nproc) does not keep in step across its ranks: run one process per learner, or build them "
        "with track_running_stats=False, or use GroupNorm or LayerNorm"
    )


def parameter_layout(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the coordinator knows of a model: each tensor's name, shape and dtype."""
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in params.items()}


def layout_difference(
    expected: Mapping[str, tuple[tuple[int, ...], str]], got: Mapping[str, tuple[tuple[int, ...], str]]
) -> str:
    """One line naming how two models' tensors differ ("" when they are the same)."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    shapes = [f"{n} {got[n][0]} vs {s}" for n, (s, _) in expected.items() if n in got and got[n][0] != s]
    dtypes = [f"{n} {got[n][1]} vs {d}" for n, (s, d) in expected.items() if n in got and got[n][1] != d]
    parts = [
        f"missing {missing[:3]}" if missing else "",
        f"unexpected {extra[:3]}" if extra else "",
        f"shapes differ: {shapes[:3]}" if shapes else "",
        f"dtypes differ: {dtypes[:3]}" if dtypes else "",
    ]
    return "; ".join(p for p in parts if p)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
