"""One inner step: plain PyTorch, nothing of the outer loop (nanoGPT's training step)."""

from __future__ import annotations

import torch

from diloco.config import TrainConfig
from diloco.model.contract import loss_and_metrics
from diloco.model.optim import lr_at


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    columns: dict[str, torch.Tensor],
    *,
    step: int,
    train: TrainConfig,
    device: torch.device,
    where: str = "the model",
) -> tuple[float, dict[str, float]]:
    """Forward, backward, clip, AdamW on a batch's columns: returns its loss and the metrics the
    forward gave. `model` may be the DDP wrapper of a torchrun group: its backward averages the
    gradients over the ranks, so every rank's AdamW step is the same."""
    lr = lr_at(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = {name: t.to(device, non_blocking=True) for name, t in columns.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(train.precision, device)):
        loss, metrics = loss_and_metrics(model(batch), where)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
    optimizer.step()
    return loss.item(), {name: value.item() for name, value in metrics.items()}


def uses_bf16(precision: str, device: torch.device) -> bool:
    """bf16 autocast: asked for, or "auto" on CUDA (tensor cores; the parameters, AdamW's state
    and the deltas stay fp32)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def straggle_s(compute_s: float, *, slow_factor: float, step_delay_s: float) -> float:
    """The sleep after a step that an experiment asks for: a straggler `slow_factor` times slower
    (its sleep scales with the step), or a fixed delay per step."""
    if slow_factor > 1.0:
        return (slow_factor - 1.0) * compute_s
    return max(0.0, step_delay_s)
