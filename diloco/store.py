"""One fsspec-backed store for raw data, shards and checkpoints.

Every path in diloco is a URI that goes through here, so `s3://bucket/prefix` is only a URI away
from a local directory: s3fs takes endpoint and credentials from the standard AWS environment
(`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, ...).

S3 specifics: one s3fs instance per process *and* AWS environment (so a changed endpoint or key is
seen), with fsspec's listings cache off, because shards and checkpoints are written by other
processes and a stale listing would say a fresh object is missing. Writes go up in
S3_BLOCK_SIZE parts: a larger object is a multipart upload, a smaller one a single PUT.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import IO

import fsspec
from fsspec.core import url_to_fs

S3_BLOCK_SIZE = 8 * 2**20  # multipart part size for writes (S3's minimum part is 5 MiB)
_S3_ENV = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
_s3_lock = threading.Lock()
_s3_filesystems: dict[tuple, fsspec.AbstractFileSystem] = {}


class StoreError(OSError):
    """A store path that cannot be read or written."""


def _s3_filesystem() -> fsspec.AbstractFileSystem:
    """The s3fs instance for this process and the current AWS environment."""
    key = (os.getpid(), *(os.environ.get(name) for name in _S3_ENV))
    with _s3_lock:
        fs = _s3_filesystems.get(key)
        if fs is None:
            if any(k[0] != key[0] for k in _s3_filesystems):
                _s3_filesystems.clear()  # made before a fork: their event loop and sockets are not ours
            options: dict = {
                # Our own cache above is keyed by the environment; fsspec's is not.
                "skip_instance_cache": True,
                "use_listings_cache": False,
                "default_block_size": S3_BLOCK_SIZE,
            }
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["endpoint_url"] = endpoint
            fs = fsspec.filesystem("s3", **options)
            _s3_filesystems[key] = fs
    return fs


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for a URI and the path inside it."""
    if uri.startswith("s3://"):
        fs = _s3_filesystem()
        return fs, fs._strip_protocol(uri)
    fs, path = url_to_fs(uri)
    return fs, path


def _fresh(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Forget any cached listing (a remote fsspec store may keep one): other processes write there."""
    fs.invalidate_cache(path)


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


def read_exact(uri: str, nbytes: int) -> bytes:
    """A file that someone else names (a data worker's shard), read only when it is a regular file
    of exactly `nbytes` bytes: its size is taken from the store first, and no more is ever read.
    Anything else (a FIFO, a device, a symlink, a directory, another size) is a StoreError, raised
    before a byte is read: read whole, a FIFO blocked the reader until a writer came, and a sparse
    1 GiB file took 1 GiB of the coordinator's memory."""
    fs, path = filesystem(uri)
    if is_local(uri):
        return _read_exact_local(uri, path, nbytes)
    _fresh(fs, path)
    try:
        info = fs.info(path)
    except FileNotFoundError as e:
        raise StoreError(f"not found: {uri}") from e
    if info.get("type") != "file":
        raise StoreError(f"{uri} is not a file ({info.get('type')})")
    if int(info.get("size") or 0) != nbytes:
        raise StoreError(f"{info.get('size')} bytes in the file, {nbytes} reported")
    data = fs.cat_file(path, start=0, end=nbytes) if nbytes else b""
    if len(data) != nbytes:  # replaced between the two calls
        raise StoreError(f"{len(data)} bytes read, {nbytes} reported")
    return data


def _read_exact_local(uri: str, path: str, nbytes: int) -> bytes:
    try:
        # lstat, then open without following a link or waiting on a FIFO, then the same file again
        # by its descriptor: what is read is the regular file that was checked.
        seen = os.lstat(path)
        if not stat.S_ISREG(seen.st_mode):
            raise StoreError(f"{uri} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise StoreError(f"not found: {uri}") from e
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            raise StoreError(f"{uri} changed while it was opened")
        if opened.st_size != nbytes:
            raise StoreError(f"{opened.st_size} bytes in the file, {nbytes} reported")
        parts, left = [], nbytes
        while left > 0:
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                raise StoreError(f"{uri} is shorter than its {nbytes} bytes")
            parts.append(part)
            left -= len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


def write_bytes_atomic(uri: str, data: bytes, mode: int = 0o666) -> None:
    """Write so a reader sees the old file or the whole new one, never a part.

    Local files: write a temporary sibling, fsync, rename; `mode` (less the umask) from the
    moment the file exists, so a secret is never readable by others, even briefly. Object stores
    already publish a PUT atomically, so the object is written once, under its final name.
    """
    fs, path = filesystem(uri)
    if is_local(uri):
        with (
            atomic_local_path(uri) as tmp,
            os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f,
        ):
            f.write(data)
        return
    # Block-sized writes, so s3fs uploads parts of S3_BLOCK_SIZE as they fill (a multipart upload
    # when there is more than one block; one PUT otherwise). On an error the upload is aborted:
    # closing the file would publish whatever parts had gone up, under the final name.
    f = fs.open(path, "wb", block_size=S3_BLOCK_SIZE)
    view = memoryview(data)
    try:
        for start in range(0, len(view), S3_BLOCK_SIZE):
            f.write(view[start : start + S3_BLOCK_SIZE])
    except BaseException:
        try:
            f.discard()
        finally:
            f.closed = True
        raise
    f.close()


@contextlib.contextmanager
def atomic_local_path(uri: str) -> Iterator[str]:
    """A temporary path beside a local file: whatever is written there replaces `uri` whole
    (fsync, rename) when the block ends, or is deleted on an error. For writers that want a path
    (safetensors' save_file) rather than bytes in memory."""
    if not is_local(uri):
        raise ValueError(f"not a local path: {uri}")
    _, path = filesystem(uri)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    _fresh(fs, path)
    return fs.exists(path)


def size(uri: str) -> int:
    fs, path = filesystem(uri)
    _fresh(fs, path)
    try:
        return int(fs.size(path))
    except FileNotFoundError as e:
        raise StoreError(f"not found: {uri}") from e


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
    _fresh(fs, path)
    if any(ch in path for ch in "*?["):
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith(".")]
    elif fs.exists(path):
        found = [path]
    else:
        raise StoreError(f"dataset not found: {uri}")
    return sorted(with_protocol(fs, p) for p in found)


def _split(uri: str) -> tuple[str, str]:
    """(scheme, the rest): ("", path) for a local path."""
    scheme, _, rest = uri.rpartition("://") if "://" in uri else ("", "", uri)
    return scheme, rest


def _local(scheme: str) -> bool:
    return scheme in ("", "file")


def uri_under(uri: str, root: str) -> bool:
    """Whether `uri` names a file strictly under `root` once normalized: the same scheme, no `..`
    climbing out, nothing but a path after the root, and for a local path no symlink leading out
    (object stores have no links). Both sides check the URIs the other names: the coordinator a
    completed shard's, a worker the shard it is told to write, read or delete."""
    (scheme, rest), (root_scheme, root_rest) = _split(uri), _split(root)
    if scheme != root_scheme or "\x00" in rest:
        return False
    path, base = posixpath.normpath(rest), posixpath.normpath(root_rest)
    if not (path.startswith(base.rstrip("/") + "/") and path == rest.rstrip("/")):
        return False
    return not _local(scheme) or os.path.realpath(path).startswith(os.path.realpath(base).rstrip("/") + "/")


def uri_within(uri: str, roots: Sequence[str]) -> bool:
    """Whether `uri` is one of `roots` (a file) or lies under one (a directory or prefix)."""
    return any(uri_under(uri, root) or _same_file(uri, root) for root in roots)


def _same_file(uri: str, root: str) -> bool:
    (scheme, rest), (root_scheme, root_rest) = _split(uri), _split(root)
    if scheme != root_scheme or "\x00" in rest or posixpath.normpath(rest) != posixpath.normpath(root_rest):
        return False
    return not _local(scheme) or os.path.realpath(rest) == os.path.realpath(root_rest)


def shard_root(store_uri: str) -> str:
    """Where a run's shards live, under its store (data.store)."""
    return join(store_uri, "shards")
