"""Global fragments and outer-optimizer state on the store, written atomically (safetensors).

One file per fragment and version: `fragment-<p>-v<version>.safetensors` holding the parameters
under their names and the Nesterov momentum under `momentum/<name>`. The file is complete on the
store before the ledger records its version, so the ledger never points at a missing file; the
previous version's file is kept until the next one is recorded. Versions merged in one group get
one file, that of the last.

A coordinator killed mid-run leaves files its successor never recorded: the fallback it kept, a
version written but not yet committed, a temporary file cut off by the kill. Each is a whole
fragment with its momentum, so a restart clears them (`tidy_fragment`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from diloco import store

MOMENTUM = "momentum/"
# A fragment's file, or the temporary sibling of one a kill cut off (diloco.store.atomic_local_path).
_FILE = re.compile(r"fragment-(\d+)-v(\d+)\.safetensors(\.tmp-\w+)?$")

log = logging.getLogger("diloco.checkpoint")


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


def files_to_remove(found: Sequence[tuple[int, bool]], current: int, keep: int = 2) -> list[tuple[int, bool]]:
    """Of one fragment's files on the store, as (version, partial), those a coordinator resuming
    at `current` removes: every partial file, complete ones newer than `current` (written, never
    committed: the merge is made again under the same name) and older ones but the newest keep − 1
    of them (the newest is the fallback a reader that looked at the ledger just before a commit
    may still open; keep = 0: none, every version stays)."""
    older = sorted(v for v, partial in found if not partial and v < current)
    kept = set(older if keep <= 0 else older[-(keep - 1) :])
    return [(v, partial) for v, partial in found if partial or v > current or (v < current and v not in kept)]


def tidy_fragment(root: str, fragment: int, current: int, keep: int = 2) -> list[int]:
    """Remove the files of `fragment` that a resume at `current` leaves behind (files_to_remove);
    returns the versions whose files stay, oldest first: the publisher removes them in turn."""
    found: dict[tuple[int, bool], list[str]] = {}
    for uri in store.list_files(store.join(root, f"fragment-{fragment}-v*")):
        match = _FILE.search(uri)
        if match and int(match.group(1)) == fragment:
            found.setdefault((int(match.group(2)), match.group(3) is not None), []).append(uri)
    removed = files_to_remove(list(found), current, keep)
    for key in removed:
        for uri in found[key]:
            store.remove(uri)
    if removed:
        log.info(
            "fragment %d: removed %d file(s) a restart left behind",
            fragment,
            sum(len(found[k]) for k in removed),
        )
    return sorted(v for v, partial in set(found) - set(removed) if not partial)
