"""Process-wide allocator tuning for the coordinator."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("diloco.coordinator")

# glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def keep_freed_memory(trim_bytes: int = 1 << 30, mmap_bytes: int = 32 << 20, arenas: int = 2) -> bool:
    """Ask glibc to keep freed blocks for reuse instead of handing them back to the OS.

    The coordinator allocates and frees fragment-sized tensors many times a second (each push's
    buffers, each merge's new parameters and momentum). By default glibc maps blocks above 128 KiB
    fresh and trims freed heap memory, so every one of those tensors is page-faulted in again:
    filling a fresh 43 MB tensor took 4x as long as filling a reused one, and ingest + merge ran
    ~12% faster with this (benchmarks/ingest.py). The cost: the process keeps its peak heap. So
    that peak does not multiply by threads, at most `arenas` malloc arenas are shared by all
    threads: with one per gRPC handler thread (glibc's default), each thread kept a fragment-sized
    heap of its own, and memory grew by a fragment per learner (benchmarks/coordinator_memory.py).
    A no-op (False) where the C library is not glibc.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = all(
        mallopt(param, value)
        for param, value in (
            (M_TRIM_THRESHOLD, trim_bytes),
            (M_MMAP_THRESHOLD, mmap_bytes),
            (M_ARENA_MAX, arenas),
        )
    )
    log.debug("allocator: keep freed memory (%s)", "on" if ok else "refused")
    return ok
