"""Hugging Face causal language models as diloco models (`pip install "diloco[hf]"`).

    [model]
    factory = "diloco.model.hf:causal_lm"
    kwargs = { model_type = "llama", hidden_size = 64, num_hidden_layers = 2, ... }

builds any `transformers` causal LM with a random init from inline settings, from a `config.json`
(`config = "path or URI"`, settings override its keys), or from a local pretrained directory
(`pretrained = "DIR"`, its safetensors). transformers is imported only here, only when used.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn

from diloco import store


class HFCausalLM(nn.Module):
    """A transformers causal LM behind diloco's contract: forward(batch) gives the model's own
    output (its `.loss` over the shifted tokens), logits(ids) lets the run sample text."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.seq_len = int(getattr(lm.config, "max_position_embeddings", 0)) or None

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        ids = batch["input_ids"]
        # transformers shifts the labels itself: row[:-1] predicts row[1:], as the built-in GPT.
        return self.lm(input_ids=ids, labels=ids, use_cache=False)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits

    def save_pretrained(self, directory: str) -> None:
        """What AutoModelForCausalLM.from_pretrained(directory) loads: config.json and safetensors."""
        self.lm.save_pretrained(directory, safe_serialization=True)


def mark_end_of_text(model: nn.Module, eot_id: int) -> None:
    """The run's end-of-text as bos and eos of a Hugging Face model's config and generation config
    (ours, or a user's own): from_config keeps the model type's defaults, Llama's 1 and 2, which
    are bytes of the byte tokenizer and a quote in a trained one, and generate() stopped there."""
    lm = getattr(model, "lm", model)
    for held in (getattr(lm, "config", None), getattr(lm, "generation_config", None)):
        if held is not None and hasattr(held, "eos_token_id"):
            held.bos_token_id = held.eos_token_id = eot_id


def causal_lm(
    *,
    vocab_size: int = 0,
    seq_len: int = 0,
    config: str = "",
    pretrained: str = "",
    model_type: str = "llama",
    **settings: Any,
) -> HFCausalLM:
    """The factory. `vocab_size` and `seq_len` are the run's (offered by diloco): inline settings
    get them unless they set their own, and a config that holds fewer is refused."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ValueError('transformers is not installed here: pip install "diloco[hf]"') from e
    if pretrained:
        lm = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, **settings)
    else:
        if config:
            values = json.loads(store.read_bytes(config).decode("utf-8"))
            model_type = values.pop("model_type", model_type)
        else:
            values = {"vocab_size": vocab_size, "max_position_embeddings": seq_len + 1} if vocab_size else {}
        values = {k: v for k, v in values.items() if not k.startswith("_") and k != "architectures"}
        lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**values, **settings}))
    held = lm.config
    if vocab_size and held.vocab_size < vocab_size:
        raise ValueError(f"the model's vocab_size {held.vocab_size} is below the tokenizer's {vocab_size}")
    positions = getattr(held, "max_position_embeddings", None)
    if seq_len and positions is not None and positions < seq_len + 1:
        raise ValueError(
            f"the model's max_position_embeddings {positions} is below model.seq_len + 1 ({seq_len + 1})"
        )
    return HFCausalLM(lm.float())


def save_tokenizer(spec: str, directory: str) -> None:
    """The run's tokenizer ("byte" or a tokenizer.json) as AutoTokenizer.from_pretrained loads it,
    with end-of-text as its eos token."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    from diloco.tokenizer import byte_tokenizer_json, load_tokenizer

    text = byte_tokenizer_json() if spec == "byte" else store.read_bytes(spec).decode("utf-8")
    ours = load_tokenizer(spec)
    tok = HFTokenizer.from_str(text)
    eos = tok.id_to_token(ours.eot_id)  # None when end-of-text is the id past the file's vocabulary
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(directory)
