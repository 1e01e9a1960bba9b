"""A whole model's parameters as one safetensors file: what a run leaves behind, and what a new
run can start from (`model.init_from`)."""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco import store
from diloco.errors import DilocoError
from diloco.model.contract import layout_difference


def save_weights(uri: str, params: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in params.items()}
    store.write_bytes_atomic(uri, st_save(tensors, metadata=metadata))


def load_weights(uri: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(store.read_bytes(uri))
    except store.StoreError as e:
        raise DilocoError(f"model.init_from: {e}") from e
    except SafetensorError as e:
        raise DilocoError(f"model.init_from: {uri} is not a safetensors file ({e})") from e


def check_matches(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], uri: str) -> None:
    """Refuse weights of another model (a different size or vocabulary), naming what differs.
    Dtypes may differ: the weights are cast to the model's."""
    diff = layout_difference(
        {n: (tuple(t.shape), "") for n, t in expected.items()},
        {n: (tuple(t.shape), "") for n, t in loaded.items()},
    )
    if diff:
        raise DilocoError(f"model.init_from: {uri} does not fit this model: {diff}")
