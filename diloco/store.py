"""One fsspec-backed store for raw data, shards and checkpoints.

Every path in diloco is a URI that goes through here, so `s3://bucket/prefix` is only a URI away
from a local directory: s3fs takes endpoint and credentials from the standard AWS environment.
"""

from __future__ import annotations

import os
import uuid
from typing import IO

import fsspec
from fsspec.core import url_to_fs


class StoreError(OSError):
    """A store path that cannot be read or written."""


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for a URI and the path inside it."""
    options: dict = {}
    if uri.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    fs, path = url_to_fs(uri, **options)
    return fs, path


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def open_read(uri: str) -> IO[bytes]:
    fs, path = filesystem(uri)
    try:
        return fs.open(path, "rb")
    except FileNotFoundError as e:
        raise StoreError(f"not found: {uri}") from e


def read_bytes(uri: str, start: int | None = None, end: int | None = None) -> bytes:
    """Whole file, or the byte range [start, end)."""
    fs, path = filesystem(uri)
    try:
        if start is None and end is None:
            return fs.cat_file(path)
        return fs.cat_file(path, start=start, end=end)
    except FileNotFoundError as e:
        raise StoreError(f"not found: {uri}") from e


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write so a reader sees the old file or the whole new one, never a part.

    Local files: write a temporary sibling, fsync, rename. Object stores already publish a PUT
    atomically, so the object is written once, under its final name.
    """
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if is_local(uri):
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return
    with fs.open(path, "wb") as f:
        f.write(data)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def size(uri: str) -> int:
    fs, path = filesystem(uri)
    return int(fs.size(path))


def makedirs(uri: str) -> None:
    fs, path = filesystem(uri)
    if is_local(uri):
        os.makedirs(path, exist_ok=True)
    else:
        fs.makedirs(path, exist_ok=True)


def remove(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.exists(path):
        fs.rm(path)


def with_protocol(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A listed path back as a URI of the same store."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return path
    return f"{protocol}://{path}"


def list_files(uri: str) -> list[str]:
    """Files at a URI: a single file, every file under a directory (recursive), or a glob; sorted."""
    fs, path = filesystem(uri)
    if any(ch in path for ch in "*?["):
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith(".")]
    elif fs.exists(path):
        found = [path]
    else:
        raise StoreError(f"dataset not found: {uri}")
    return sorted(with_protocol(fs, p) for p in found)
