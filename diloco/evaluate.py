"""Evaluation helpers: held-out loss, the unigram baseline beside it, and a text sample."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F


def eval_loss(
    model: nn.Module,
    rows: np.ndarray,
    batch_size: int,
    device: torch.device | str,
    max_batches: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats/token) over `rows` [n, seq_len+1], in row order.

    Each row gives x = row[:-1], y = row[1:]. The mean is over tokens, so a short last batch weighs
    what its tokens weigh. The model's train/eval mode is restored afterwards.
    """
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n, seq_len+1] with seq_len >= 1, got shape {rows.shape}")
    n = rows.shape[0]
    if max_batches is not None:
        n = min(n, max_batches * batch_size)
    if n == 0:
        raise ValueError("no rows to evaluate on")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                batch = torch.from_numpy(rows[start : min(start + batch_size, n)].astype(np.int64))
                batch = batch.to(device)
                x, y = batch[:, :-1], batch[:, 1:]
                logits, _ = model(x)
                # sum, not mean, so batches of different sizes combine exactly
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum"
                )
                total += loss.item()
                count += y.numel()
    finally:
        model.train(was_training)
    return total / count


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


def sample_text(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    device: torch.device | str,
    seed: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
) -> str:
    """The prompt followed by up to max_new_tokens sampled tokens, decoded; it stops at the first
    end-of-text token. The same seed gives the same text on the same device."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]  # an empty prompt starts a new document
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    finally:
        model.train(was_training)
    new = out[0, len(ids) :].tolist()
    if tokenizer.eot_id in new:
        new = new[: new.index(tokenizer.eot_id)]
    return prompt + tokenizer.decode(new)
