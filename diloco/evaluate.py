"""Evaluation helpers: held-out loss and metrics of any model, the unigram baseline beside a token
model's loss, and a text sample."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from diloco.errors import DilocoError
from diloco.model.contract import column_tensor, loss_and_metrics


@dataclass
class EvalResult:
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    rows: int = 0


def evaluate(
    model: nn.Module,
    columns: dict[str, np.ndarray],
    batch_size: int,
    device: torch.device | str,
    max_batches: int | None = None,
    where: str = "the model",
) -> EvalResult:
    """The model's mean loss (and metrics) over the held-out rows, in row order, by its own
    forward: a batch's mean weighs what its rows weigh, so a short last batch counts for what it
    holds (for token rows of one length, that is the mean over tokens). The model's train/eval
    mode is restored afterwards."""
    n = min(len(c) for c in columns.values())
    if max_batches is not None:
        n = min(n, max_batches * batch_size)
    if n == 0:
        raise ValueError("no rows to evaluate on")
    was_training = model.training
    model.eval()
    total, sums = 0.0, {}
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                end = min(start + batch_size, n)
                batch = {name: column_tensor(c[start:end]).to(device) for name, c in columns.items()}
                loss, metrics = loss_and_metrics(model(batch), where)
                total += loss.item() * (end - start)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.item() * (end - start)
    finally:
        model.train(was_training)
    return EvalResult(total / n, {name: value / n for name, value in sums.items()}, n)


def eval_loss(
    model: nn.Module,
    rows: np.ndarray,
    batch_size: int,
    device: torch.device | str,
    max_batches: int | None = None,
) -> float:
    """Mean next-token loss (nats/token) of a token model over packed rows [n, seq_len+1]."""
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n, seq_len+1] with seq_len >= 1, got shape {rows.shape}")
    return evaluate(model, {"input_ids": rows}, batch_size, device, max_batches).loss


def unigram_entropy(token_arrays: Iterable[np.ndarray], vocab_size: int) -> float:
    """Entropy (nats) of the tokens' empirical frequency: the loss of the best predictor that
    ignores context. A model whose eval loss is not below this has learned nothing about order."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for arr in token_arrays:
        flat = np.asarray(arr).ravel()
        if flat.size == 0:
            continue
        if int(flat.max()) >= vocab_size:
            raise ValueError(f"token id {int(flat.max())} is outside the vocabulary of {vocab_size}")
        counts += np.bincount(flat.astype(np.int64), minlength=vocab_size)
    total = counts.sum()
    if total == 0:
        raise ValueError("no tokens to compute the unigram entropy of")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0 turns -0.0 (one distinct token) into 0.0


def check_sampling(max_new_tokens: int, temperature: float) -> None:
    """Refuse what cannot be sampled, naming `diloco generate`'s flag: a negative temperature
    divides the logits by a negative number (the least likely tokens come first: junk)."""
    if max_new_tokens < 0:
        raise DilocoError(f"--tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # NaN too
        raise DilocoError(f"--temperature must be >= 0 (0: greedy), got {temperature:g}")


def sample_text(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    device: torch.device | str,
    seed: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    window: int | None = None,
) -> str:
    """The prompt followed by up to max_new_tokens sampled tokens, decoded; it stops at the first
    end-of-text token. The same seed gives the same text on the same device. `window`: the longest
    context the model takes (the run's model.seq_len)."""
    check_sampling(max_new_tokens, temperature)
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]  # an empty prompt starts a new document
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = generate(
            model,
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
            window=window,
        )
    finally:
        model.train(was_training)
    new = out[0, len(ids) :].tolist()
    if tokenizer.eot_id in new:
        new = new[: new.index(tokenizer.eot_id)]
    return prompt + tokenizer.decode(new)


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens sampled from `model.logits`; temperature <= 0
    is greedy. The context is cut to `window` (the run's model.seq_len), else to the model's own
    `seq_len` when it has one: a user's model with learned positions for seq_len tokens fails on
    a longer context (an IndexError in its position embedding)."""
    window = window or getattr(model, "seq_len", None)
    for _ in range(max_new_tokens):
        idx_cond = idx if window is None or idx.size(1) <= window else idx[:, -window:]
        logits = model.logits(idx_cond)[:, -1, :]
        if temperature <= 0:
            idx_next = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def can_sample(model: nn.Module) -> bool:
    """A token model that gives its logits (the contract's optional `logits`) can write a sample."""
    return callable(getattr(model, "logits", None))
