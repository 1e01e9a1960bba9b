"""Model FLOPs utilization: the share of the devices' peak that the model's own arithmetic uses.

MFU = tokens/s × FLOPs per token / (peak FLOP/s × ranks), with the PaLM paper's estimate of a
training step's FLOPs per token, 6 × parameters (forward 2N, backward 4N; attention's share is
left out, small at these context lengths). Peaks are the vendors' dense bf16 figures; a device
not in the table (every CPU) reports 0: unknown, rather than a guess.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (FLOP/s), from NVIDIA's data sheets (SXM parts).
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float:
    """The device's dense bf16 peak, or 0 when it is not known."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), 0.0)


def mfu(tokens_per_s: float, params: int, peak_per_rank: float, ranks: int = 1) -> float:
    """The model FLOPs utilization of a learner of `ranks` devices (0 with no known peak)."""
    if peak_per_rank <= 0 or ranks <= 0:
        return 0.0
    return tokens_per_s * 6.0 * params / (peak_per_rank * ranks)
