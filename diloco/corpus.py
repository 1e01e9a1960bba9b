"""Datasets to file lists: the embedded stdlib corpus, or any directory/glob/file in the store."""

from __future__ import annotations

import os
import sysconfig

from diloco import store

# The embedded default corpus: the Python standard library's own source.
STDLIB = "stdlib"

# Directory names left out of the stdlib corpus, so it does not depend on what is installed.
_STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

# File kinds by suffix. Compressed variants (.gz/.zst) will add entries to _COMPRESSION and be
# recognised by stripping that suffix first; everything else keys off the inner suffix.
TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIXES = (".jsonl",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES
_COMPRESSION: dict[str, str] = {}  # suffix -> codec name; empty until compressed inputs land


def _split_compression(uri: str) -> tuple[str, str | None]:
    """The URI without its compression suffix, and the codec (None when not compressed)."""
    for suffix, codec in _COMPRESSION.items():
        if uri.endswith(suffix):
            return uri[: -len(suffix)], codec
    return uri, None


def file_kind(uri: str) -> str | None:
    """ "text", "jsonl", or None when diloco cannot read this file."""
    inner, _ = _split_compression(uri)
    if inner.endswith(TEXT_SUFFIXES):
        return "text"
    if inner.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def is_splittable(uri: str) -> bool:
    """Whether a file may be cut at byte offsets (compressed files must be read whole)."""
    return _split_compression(uri)[1] is None


def stdlib_files() -> list[str]:
    """The stdlib's .py files, sorted by path, without tests, IDLE and installed packages."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == os.curdir else rel.split(os.sep)
        if _STDLIB_EXCLUDED.intersection(parts):
            dirnames.clear()  # nothing below an excluded directory counts
            continue
        found.extend(os.path.join(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(found)


def resolve_dataset(dataset: str) -> list[str]:
    """The readable files of a dataset: "stdlib", or a directory, glob or single file URI."""
    if dataset == STDLIB:
        files = stdlib_files()
        if not files:
            raise store.StoreError(f"no .py files in the stdlib at {sysconfig.get_paths()['stdlib']}")
        return files
    files = [f for f in store.list_files(dataset) if file_kind(f) is not None]
    if not files:
        kinds = "/".join(SUPPORTED_SUFFIXES)
        raise store.StoreError(f"no {kinds} files in {dataset}")
    return files
