"""The digits' model factory (model.factory), built on every learner: a small CNN that returns its
loss and its accuracy (a metric, averaged over the held-out rows like the loss)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F


class DigitsCNN(nn.Module):
    def __init__(self, channels: int, classes: int, batchnorm: bool = False) -> None:
        super().__init__()

        def norm(c: int) -> list[nn.Module]:
            # BatchNorm's running statistics travel with the parameters (merged as a plain mean),
            # and are recomputed for the global weights wherever they are evaluated or exported.
            # Without it, the layers keep their names.
            return [nn.BatchNorm2d(c)] if batchnorm else []

        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            *norm(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            *norm(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8×8 -> 4×4
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * channels * 16, 64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, object]:
        logits = self.head(self.features(batch["pixels"]))
        accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
        return {"loss": F.cross_entropy(logits, batch["label"]), "metrics": {"accuracy": accuracy}}


def cnn(*, channels: int = 16, classes: int = 10, batchnorm: bool = False) -> DigitsCNN:
    return DigitsCNN(channels, classes, batchnorm)
