"""Global fragments and outer-optimizer state on the store, written atomically (safetensors).

One file per fragment and version: `fragment-<p>-v<version>.safetensors` holding the parameters
under their names and the Nesterov momentum under `momentum/<name>`. The file is complete on the
store before the ledger records its version, so the ledger never points at a missing file; the
previous version's file is kept until the next one is recorded. Versions merged in one group get
one file, that of the last.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from diloco import store

MOMENTUM = "momentum/"


def fragment_uri(root: str, fragment: int, version: int) -> str:
    return store.join(root, f"fragment-{fragment}-v{version:08d}.safetensors")


def save_fragment(
    root: str, fragment: int, version: int, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor]
) -> str:
    tensors = {name: t.contiguous() for name, t in params.items()}
    tensors.update({MOMENTUM + name: m.contiguous() for name, m in momentum.items()})
    metadata = {"fragment": str(fragment), "version": str(version)}
    uri = fragment_uri(root, fragment, version)
    if store.is_local(uri):  # straight to the file: no second copy of the fragment in memory
        with store.atomic_local_path(uri) as tmp:
            st_save_file(tensors, tmp, metadata=metadata)
    else:
        store.write_bytes_atomic(uri, st_save(tensors, metadata=metadata))
    return uri


def load_fragment(
    root: str, fragment: int, version: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    tensors = st_load(store.read_bytes(fragment_uri(root, fragment, version)))
    params = {k: v for k, v in tensors.items() if not k.startswith(MOMENTUM)}
    momentum = {k[len(MOMENTUM) :]: v for k, v in tensors.items() if k.startswith(MOMENTUM)}
    return params, momentum


def remove_fragment(root: str, fragment: int, version: int) -> None:
    """Delete one version's file (the ledger no longer points at it)."""
    store.remove(fragment_uri(root, fragment, version))


def load_model_params(root: str, versions: list[int]) -> dict[str, torch.Tensor]:
    """Every fragment's parameters at the given versions, merged into one name -> tensor dict."""
    out: dict[str, torch.Tensor] = {}
    for fragment, version in enumerate(versions):
        params, _ = load_fragment(root, fragment, version)
        out.update(params)
    return out
