"""The example's model as a factory: train.py builds it, and the coordinator names it
(`--model own_model:llama`), so `diloco eval`, `generate` and `export` rebuild the model the run's
weights are. Code never travels: every machine that builds the model imports this file (here,
with PYTHONPATH=examples/own-loop).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import LlamaConfig


class LlamaForCausalLM(transformers.LlamaForCausalLM):
    """A Hugging Face Llama, its tensor names and forward unchanged for your loop, which also keeps
    diloco's model convention (diloco.model.contract): `model(batch)` gives the loss of a batch of
    shard rows (`diloco eval`), `logits(ids)` lets `diloco generate` sample. Named as transformers'
    class: an export's config.json names an architecture every loader knows."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.seq_len = config.max_position_embeddings  # the context `diloco generate` keeps

    def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
        if isinstance(input_ids, dict):  # diloco's batch: {"input_ids": (B, seq_len + 1)}
            ids = input_ids["input_ids"]
            return super().forward(input_ids=ids, labels=ids, use_cache=False)
        return super().forward(input_ids=input_ids, **kwargs)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=ids, use_cache=False).logits


def llama(*, vocab_size: int = 257, seq_len: int = 128) -> LlamaForCausalLM:
    """vocab_size and seq_len are offered by the run (257: diloco's byte tokens, 256 bytes and
    end-of-text); the defaults are the run's when it keeps the default tokenizer and seq_len."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len + 1,  # a shard row: seq_len + 1 tokens
    )
    return LlamaForCausalLM(config)
