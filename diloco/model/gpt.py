"""The built-in GPT: a small nanoGPT-shaped decoder-only transformer, readable in one sitting.

Parameter names (``named_parameters()``) are part of the wire contract: fragments of the model
travel between learners and the syncer keyed by these names, so do not rename modules lightly.
The language-model head shares its weight with the token embedding (weight tying); the shared
tensor appears once in ``named_parameters()``, as ``transformer.wte.weight``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from diloco.config import ModelConfig, TrainConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: the residual stream is never normalised, only what reads it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.config = cfg
        self.vocab_size = vocab_size
        self.seq_len = cfg.seq_len
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.seq_len, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
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

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 token ids, T <= seq_len. Returns logits (B, T, vocab) and
        the mean cross-entropy over every position (None without targets)."""
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.seq_len}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens).

        temperature <= 0 means greedy decoding. Put the model in eval mode first (dropout)."""
        for _ in range(max_new_tokens):
            # the model knows only seq_len positions: condition on the most recent ones
            idx_cond = idx if idx.size(1) <= self.seq_len else idx[:, -self.seq_len :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :]
            if temperature <= 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> GPT:
    """A freshly initialised GPT on CPU; the same seed gives bitwise-identical parameters.

    Every learner builds its starting point this way, so the seed (not a tensor download) is what
    makes all of them start from the same Θ.
    """
    # Module constructors draw their default init from the global RNG; we overwrite all of it, so
    # fork the RNG to leave the caller's random state exactly as it was.
    with torch.random.fork_rng(devices=[]):
        model = GPT(cfg, vocab_size)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    model.init_weights(generator)
    return model


def make_inner_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW as nanoGPT configures it: weight decay on every >=2-D tensor (matmul weights and the
    embeddings), none on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2))


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate for 0-based inner step `step`: linear warmup to train.lr, then constant.

    No cosine decay: runs are budgeted by time and tokens across learners that come and go, so the
    total number of steps a learner will take is unknown when it takes them.
    """
    if train.warmup_steps > 0 and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    return train.lr
