"""A learner's local copy of the shards it read from a remote store: bounded, LRU, verified.

Shards on S3 cost a download each time they are read; a learner reads one again when a lease it
held came back to it (a restart, a lost lease, rows handed back), and every learner on a machine
reads the same store. The cache keeps the file bytes under a size limit in a local directory:

- files are named by the sha256 of (URI, checksum), so a repaired shard (new checksum) or another
  run's shard never matches a stale copy;
- a copy is written to a temporary sibling and renamed into place, so a reader (this process or
  another learner sharing the directory) sees no file or the whole file;
- every read is decoded and verified against the checksum the coordinator gave; a cached copy that
  fails is deleted and the shard is fetched from the store again, never trained on;
- least recently used copies (by mtime, touched on each hit) are evicted once the total passes
  the limit; a shard larger than the whole limit is not cached.

A local store gains nothing from a copy (the file already is local and the page cache serves a
re-read), so the default setting caches only shards whose URI is remote.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from diloco import store
from diloco.data.shard import Shard, ShardCorrupt, decode_shard, read_shard

log = logging.getLogger("diloco.cache")

DEFAULT_CACHE_BYTES = 2 << 30
SUFFIX = ".shard"
# A temporary file this old belongs to a writer that died: the next eviction removes it.
STALE_TMP_S = 3600.0


def default_cache_dir() -> Path:
    """The per-user cache directory: $XDG_CACHE_HOME/diloco/shards, else ~/.cache/diloco/shards."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diloco" / "shards"


@dataclass
class CacheStats:
    hits: int = 0  # verified copies served from the cache
    misses: int = 0  # reads from the store
    corrupt: int = 0  # cached copies that failed verification (deleted, fetched again)
    evicted: int = 0
    bytes_fetched: int = 0  # bytes read from the store

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ShardCache:
    """Shard file bytes in `directory`, at most `max_bytes` of them (LRU).

    remote_only: read local URIs straight from the store, without a copy (the default setting).
    Safe to share between threads and between processes that use the same directory.
    """

    def __init__(
        self, directory: str | Path, max_bytes: int = DEFAULT_CACHE_BYTES, remote_only: bool = False
    ):
        self.directory = Path(directory)
        self.max_bytes = max(0, int(max_bytes))
        self.remote_only = remote_only
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._broken = False  # the directory could not be written: go on without a cache

    # -- the shard reader -----------------------------------------------------------------------

    def read(self, uri: str, expected_checksum: str | None = None) -> Shard:
        """The verified shard: from the cache when a good copy is there, else from the store.

        Raises ShardCorrupt when the store's own copy fails verification, StoreError when the
        store cannot be read: what read_shard raises.
        """
        if self.remote_only and store.is_local(uri):
            return read_shard(uri, expected_checksum)
        data = self.get(uri, expected_checksum)
        if data is not None:
            try:
                shard = decode_shard(data, expected_checksum)
                with self._lock:
                    self.stats.hits += 1
                return shard
            except ShardCorrupt as e:
                log.warning("cached copy of %s is corrupt (%s): deleted, fetching it again", uri, e)
                self.discard(uri, expected_checksum)
                with self._lock:
                    self.stats.corrupt += 1
        data = store.read_bytes(uri)
        with self._lock:
            self.stats.misses += 1
            self.stats.bytes_fetched += len(data)
        shard = _decode(uri, data, expected_checksum)  # only verified bytes are cached
        self.put(uri, expected_checksum, data)
        return shard

    # -- the file store -------------------------------------------------------------------------

    def path_for(self, uri: str, checksum: str | None) -> Path:
        key = hashlib.sha256(f"{uri}\0{checksum or ''}".encode()).hexdigest()[:40]
        return self.directory / f"{key}{SUFFIX}"

    def get(self, uri: str, checksum: str | None) -> bytes | None:
        """The cached bytes (not yet verified), or None. A hit makes the copy most recently used."""
        path = self.path_for(uri, checksum)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("shard cache: cannot read %s: %s", path, e)
            return None
        with contextlib.suppress(OSError):  # evicted meanwhile: the bytes read are whole all the same
            os.utime(path)
        return data

    def put(self, uri: str, checksum: str | None, data: bytes) -> bool:
        """Keep a copy (atomically: temporary file, then rename), then evict down to the limit."""
        if self._broken or len(data) > self.max_bytes:
            return False
        path = self.path_for(uri, checksum)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            # A cache must never stop training: warn once and read from the store from now on.
            log.warning("shard cache disabled: cannot write in %s: %s", self.directory, e)
            self._broken = True
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        self.evict(keep=path)
        return True

    def discard(self, uri: str, checksum: str | None) -> None:
        with contextlib.suppress(OSError):
            self.path_for(uri, checksum).unlink(missing_ok=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of each cached copy, least recently used first (reads only)."""
        return sorted(
            ((mtime, size, path) for mtime, size, path in self._listing() if path.name.endswith(SUFFIX)),
            key=lambda e: (e[0], e[2].name),
        )

    def _listing(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every file in the directory, copies and temporary files alike."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        found = []
        for name in names:
            path = self.directory / name
            try:
                st = path.stat()
            except OSError:
                continue  # removed meanwhile
            found.append((st.st_mtime, st.st_size, path))
        return found

    def size_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: Path | None = None) -> int:
        """Delete least recently used copies until the total is within the limit (and temporary
        files a killed writer left); returns how many copies went."""
        for path in stale_temporaries(self._listing(), time.time()):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        removed = 0
        for path in lru_evictions(self.entries(), self.max_bytes, keep):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # gone, by us or by another process
            removed += 1
        if removed:
            with self._lock:
                self.stats.evicted += removed
        return removed


def lru_evictions(entries: list[tuple[float, int, Path]], max_bytes: int, keep: Path | None) -> list[Path]:
    """The copies to delete, least recently used first (`entries` in that order), until the rest fit
    in `max_bytes`; never `keep` (the copy just written)."""
    total = sum(size for _, size, _ in entries)
    doomed = []
    for _, size, path in entries:
        if total <= max_bytes:
            break
        if path != keep:
            doomed.append(path)
            total -= size
    return doomed


def stale_temporaries(listing: list[tuple[float, int, Path]], now: float) -> list[Path]:
    """Temporary files older than STALE_TMP_S: a writer killed between write and rename left them
    (a live writer's are younger)."""
    return [path for mtime, _, path in listing if ".tmp-" in path.name and now - mtime > STALE_TMP_S]


def open_cache(setting: str, max_bytes: int) -> ShardCache | None:
    """The cache the config asks for: data.cache_dir ("" auto, "off", or a directory), data.cache_bytes.

    "" (the default) caches in the per-user cache directory, and only shards on a remote store;
    a directory caches every shard there (say, a fast local disk in front of a network mount);
    "off" or a limit of 0 bytes reads every shard from the store.
    """
    setting = setting.strip()
    if setting.lower() == "off" or max_bytes <= 0:
        return None
    if not setting:
        return ShardCache(default_cache_dir(), max_bytes, remote_only=True)
    return ShardCache(Path(os.path.expandvars(os.path.expanduser(setting))), max_bytes)


def read_shard_via(cache: ShardCache | None, uri: str, expected_checksum: str | None = None) -> Shard:
    """read_shard, through the cache when there is one."""
    if cache is None:
        return read_shard(uri, expected_checksum)
    return cache.read(uri, expected_checksum)


def _decode(uri: str, data: bytes, expected_checksum: str | None) -> Shard:
    try:
        return decode_shard(data, expected_checksum)
    except ShardCorrupt as e:
        raise ShardCorrupt(f"{uri}: {e}") from e
