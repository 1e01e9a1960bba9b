"""Datasets to file lists: the embedded stdlib corpus, or any directory/glob/file in the store."""

from __future__ import annotations

import os
import sysconfig

from diloco import store

# The embedded default corpus: the Python standard library's own source.
STDLIB = "stdlib"

# Directory names left out of the stdlib corpus, so it does not depend on what is installed.
_STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

# File kinds by suffix. Compressed variants (.gz/.zst) are recognised by stripping the compression
# suffix first; everything else keys off the inner suffix. Parquet is read by row group, never
# compressed on top (parquet compresses its own pages).
TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
_COMPRESSION: dict[str, str] = {".gz": "gzip", ".zst": "zstd"}  # suffix -> codec name
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
# Read only by a preprocess (data.preprocess): records of samples, not text to tokenize.
CSV_SUFFIXES = (".csv",)
ARRAY_SUFFIXES = {".npy": "npy", ".npz": "npz"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SAMPLE_SUFFIXES = (*SUPPORTED_SUFFIXES, *CSV_SUFFIXES, *ARRAY_SUFFIXES, *IMAGE_SUFFIXES)
TEXT_KINDS = ("text", "jsonl", "parquet")


def _split_compression(uri: str) -> tuple[str, str | None]:
    """The URI without its compression suffix, and the codec (None when not compressed)."""
    for suffix, codec in _COMPRESSION.items():
        if uri.endswith(suffix):
            return uri[: -len(suffix)], codec
    return uri, None


def compression(uri: str) -> str | None:
    """ "gzip", "zstd", or None when the file is stored uncompressed."""
    return _split_compression(uri)[1]


def file_kind(uri: str) -> str | None:
    """ "text", "jsonl", "parquet", "csv", "npy", "npz", "image", or None when diloco cannot read
    this file. Only text, JSONL and CSV may be compressed (.gz, .zst)."""
    inner, codec = _split_compression(uri)
    if inner.endswith(TEXT_SUFFIXES):
        return "text"
    if inner.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if inner.endswith(CSV_SUFFIXES):
        return "csv"
    if codec is not None:
        return None
    if inner.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if inner.lower().endswith(IMAGE_SUFFIXES):
        return "image"
    return next((kind for suffix, kind in ARRAY_SUFFIXES.items() if inner.endswith(suffix)), None)


def is_splittable(uri: str) -> bool:
    """Whether a file may be cut at byte offsets: after newlines (text, JSONL, CSV), or between
    rows (.npy, see diloco.data.arrays).

    Compressed files must be decoded from their start, so each is one segment; parquet files are
    cut by row group instead (see diloco.data.chunks).
    """
    return compression(uri) is None and file_kind(uri) in ("text", "jsonl", "csv", "npy")


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


def resolve_dataset(dataset: str, samples: bool = False) -> list[str]:
    """The readable files of a dataset: "stdlib", or a directory, glob or single file URI. Text to
    tokenize (the default), or with `samples` every kind a preprocess reads (data.preprocess)."""
    if dataset == STDLIB:
        files = stdlib_files()
        if not files:
            raise store.StoreError(f"no .py files in the stdlib at {sysconfig.get_paths()['stdlib']}")
        return files
    files = [
        f
        for f in store.list_files(dataset)
        if file_kind(f) is not None and (samples or file_kind(f) in TEXT_KINDS)
    ]
    if not files:
        names = "/".join(SAMPLE_SUFFIXES if samples else SUPPORTED_SUFFIXES)
        codecs = "/".join(_COMPRESSION)
        hint = "" if samples else "; images, .csv, .npy and .npz need data.preprocess"
        raise store.StoreError(
            f"no {names} files in {dataset} (text, JSONL and CSV may also be {codecs}{hint})"
        )
    return files


def dataset_key(dataset: str) -> str:
    """A dataset's identity, to tell whether two spellings name the same data: the stdlib name,
    a local path made absolute (symlinks resolved), or a remote URI, without a trailing slash."""
    if dataset == STDLIB:
        return dataset
    if store.is_local(dataset):
        return os.path.realpath(os.path.expanduser(dataset.removeprefix("file://")))
    return dataset.rstrip("/")
