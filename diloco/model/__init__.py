"""The models: the factory that builds the run's model, the built-in GPT, the inner optimizer."""

from diloco.model.factory import build_model
from diloco.model.gpt import GPT
from diloco.model.optim import lr_at, make_inner_optimizer

__all__ = ["GPT", "build_model", "lr_at", "make_inner_optimizer"]
