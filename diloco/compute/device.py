"""Where a learner computes: device choice and CPU thread count."""

from __future__ import annotations

import torch

from diloco.config_checks import DEVICE_FORMS, is_device_spec
from diloco.errors import DilocoError


def pick_device(spec: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; "cpu", "cuda" or "cuda:N" checked against this machine.

    A device that is not there is refused here, with the reason (a DilocoError: one clear line),
    rather than at the first tensor moved onto it deep inside the training loop.
    """
    spec = spec.strip().lower()
    if spec in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not is_device_spec(spec):
        raise DilocoError(f"unknown device {spec!r} (use {DEVICE_FORMS})")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DilocoError(f"device {spec!r} requested but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DilocoError(f"device {spec!r} requested but this machine has {count} CUDA device(s)")
    return device


def set_threads(n: int) -> None:
    """Set torch's intra-op threads; n <= 0 leaves torch's default (all cores).

    Several learners on one machine should split the cores between them, or they thrash.
    """
    if n > 0:
        torch.set_num_threads(n)
