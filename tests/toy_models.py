"""Model factories as a user would write them, installed where the learners run (the tests package)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.nn import functional as F


class TinyLM(nn.Module):
    """A bigram-ish token model: embedding, one hidden layer, logits. Returns its loss and the
    next-token accuracy as a metric."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab_size)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(idx))))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, object]:
        rows = batch["input_ids"]
        logits = self.logits(rows[:, :-1])
        targets = rows[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return {"loss": loss, "metrics": {"accuracy": accuracy}}


def tiny_lm(*, vocab_size: int, width: int = 16) -> TinyLM:
    # TOY_LM_SCALE stands for another version of this package installed on one machine.
    return TinyLM(vocab_size, width * int(os.environ.get("TOY_LM_SCALE", "1")))


class LogitsOnly(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(batch["input_ids"])


def no_loss(*, vocab_size: int) -> nn.Module:
    """A forward that returns logits, not a loss: the learner refuses it with one line."""
    return LogitsOnly(vocab_size)


def not_a_module() -> dict:
    return {"weight": torch.zeros(2)}


TOY_CONSTANT = 3


def batchnorm_mlp(**_: object) -> nn.Module:
    """A model with BatchNorm's running statistics (they travel with its parameters)."""
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def needs_label(records: list[dict]) -> dict:
    """A preprocess written for labelled records: text records have no label (KeyError)."""
    import numpy as np

    return {"label": np.array([r["label"] for r in records])}


class TokenBatchNorm(nn.Module):
    """Token rows through BatchNorm: running statistics a token run's export recomputes."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, vocab_size)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = batch["input_ids"]
        return F.cross_entropy(self.head(self.bn(self.embed(rows[:, :-1]).mean(1))), rows[:, -1])


def batchnorm_tokens(*, vocab_size: int) -> nn.Module:
    return TokenBatchNorm(vocab_size)
