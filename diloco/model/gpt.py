"""The built-in GPT: a small nanoGPT-shaped decoder-only transformer, readable in one sitting.

It is the default model factory (`model.factory = "diloco.model.gpt:gpt"`), built through the same
path as any user's model: `gpt(**model.kwargs)` returns the module, whose forward takes a batch of
named columns and returns its loss.

Parameter names (``named_parameters()``) are part of the wire contract: fragments of the model
travel between learners and the syncer keyed by these names, so do not rename modules lightly.
The language-model head shares its weight with the token embedding (weight tying); the shared
tensor appears once in ``named_parameters()``, as ``transformer.wte.weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        # query, key and value projections for all heads, in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # flash / memory-efficient kernels where available; no mask buffer to carry around
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: the residual stream is never normalised, only what reads it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {cfg.vocab_size}")
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.seq_len, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): one tensor both embeds and un-embeds tokens. It is one
        # Parameter object, so named_parameters()/parameters() yield it once (as
        # transformer.wte.weight) and an optimizer or a fragment sees it once.
        self.lm_head.weight = self.transformer.wte.weight

    def init_weights(self, generator: torch.Generator) -> None:
        """nanoGPT/GPT-2 init, drawn from `generator` so a seed fixes every parameter."""
        std = 0.02
        # Residual projections are scaled so the residual stream's variance does not grow with
        # depth: each block adds two of them, hence 2 * n_layer.
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, resid_std, generator=generator)
                elif name.endswith(".bias"):
                    p.zero_()
                elif ".ln_" in name:
                    p.fill_(1.0)  # LayerNorm gain (its bias is handled above)
                else:
                    p.normal_(0.0, std, generator=generator)  # linear weights and embeddings

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (the tied embedding/head counts once).

        non_embedding leaves out the position embedding, as nanoGPT does for reporting; the token
        embedding stays in because, tied, it is also the output layer.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 token ids, T <= seq_len. Returns the next-token logits (B, T, vocab)."""
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.seq_len}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """batch["input_ids"]: (B, T + 1) packed token rows. Returns the mean next-token
        cross-entropy over every position: row[:-1] predicts row[1:]."""
        rows = batch["input_ids"]
        x, y = rows[:, :-1], rows[:, 1:]
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)


def gpt(
    *,
    vocab_size: int,
    seq_len: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.0,
) -> GPT:
    """The built-in model factory: a GPT with nanoGPT's init, drawn from torch's RNG, which the
    caller seeds (diloco.model.factory.build_model): the same seed gives the same parameters."""
    model = GPT(GPTConfig(vocab_size, seq_len, n_layer, n_head, n_embd, dropout))
    generator = torch.Generator(device="cpu")
    generator.manual_seed(torch.initial_seed())
    model.init_weights(generator)
    return model
