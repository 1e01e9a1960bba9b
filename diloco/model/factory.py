"""Build the run's model from its factory: "package.module:function" imported where the learner
runs, called with model.kwargs, under a seeded RNG so every learner builds the same init."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from diloco.config import ModelConfig
from diloco.errors import DilocoError
from diloco.plugins import resolve

# What the run knows and offers a factory that takes parameters of these names.
OFFERED = ("vocab_size", "seq_len")


def factory_kwargs(fn: Callable[..., Any], model: ModelConfig) -> dict[str, Any]:
    """model.kwargs, plus the offered values the function takes by name and kwargs leaves out."""
    kwargs = dict(model.kwargs)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it kwargs alone
        return kwargs
    for name in OFFERED:
        if name in params and name not in kwargs:
            kwargs[name] = getattr(model, name)
    return kwargs


def kwargs_problem(model: ModelConfig) -> str | None:
    """Why model.kwargs cannot be given to the factory, or None: a name the function does not take
    (unless it takes **kwargs). Said before a job starts, not by every learner at its first build."""
    fn = resolve(model.factory, "model.factory")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    if unknown := sorted(set(model.kwargs) - set(params)):
        taken = ", ".join(n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
        return (
            f"model.kwargs {', '.join(unknown)}: {model.factory} takes none of that name (it takes: {taken})"
        )
    return None


def build_model(model: ModelConfig, vocab_size: int = 0, seed: int = 0) -> nn.Module:
    """A freshly initialised model on CPU; the same seed gives the same parameters. `vocab_size`,
    when given, stands in for model.vocab_size (0 there: "take it from the tokenizer").

    Every learner builds its starting point this way, so the seed (not a tensor download) is what
    makes all of them start from the same Θ.
    """
    if vocab_size:
        model = replace(model, vocab_size=vocab_size)
    fn = resolve(model.factory, "model.factory")
    kwargs = factory_kwargs(fn, model)
    # Modules draw their init from the global RNG: seed it, in a fork that leaves the caller's
    # random state exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            built = fn(**kwargs)
        except (TypeError, ValueError) as e:
            raise DilocoError(f"model.factory {model.factory} refused model.kwargs {kwargs}: {e}") from e
    if not isinstance(built, nn.Module):
        raise DilocoError(
            f"model.factory {model.factory} returned a {type(built).__name__}, not an nn.Module"
        )
    if not any(True for _ in built.parameters()):
        raise DilocoError(f"model.factory {model.factory} built a module without parameters")
    return built
