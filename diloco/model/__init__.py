"""The built-in GPT and its inner-loop optimizer."""

from diloco.model.gpt import GPT, build_model, lr_at, make_inner_optimizer

__all__ = ["GPT", "build_model", "lr_at", "make_inner_optimizer"]
