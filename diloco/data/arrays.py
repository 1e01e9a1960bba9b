"""A .npy file cut by rows: its header says where each row's bytes are, so a big array is many
chunks of whole rows, each read without the others (no pickled objects: allow_pickle stays off).

A segment of a .npy file is a byte range whose ends fall between rows; the first one also holds
the header. Fortran-ordered arrays, 0-d arrays and arrays of objects stay one segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco import store


@dataclass(frozen=True)
class NpyLayout:
    shape: tuple[int, ...]
    dtype: np.dtype
    data_offset: int  # where row 0 starts
    row_bytes: int

    @property
    def rows(self) -> int:
        return self.shape[0]


def npy_layout(uri: str) -> NpyLayout | None:
    """Where a .npy file's rows lie; None when it cannot be cut by rows."""
    with store.open_read(uri) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
    if fortran or not shape or dtype.hasobject:
        return None
    return NpyLayout(tuple(shape), dtype, offset, dtype.itemsize * math.prod(shape[1:]))


def npy_cuts(uri: str, size: int, chunk_bytes: int) -> list[int]:
    """Byte offsets between rows, about `chunk_bytes` apart (at least one row per segment)."""
    layout = npy_layout(uri)
    if layout is None or layout.row_bytes == 0:
        return []
    per_chunk = max(1, chunk_bytes // layout.row_bytes)
    return [layout.data_offset + r * layout.row_bytes for r in range(per_chunk, layout.rows, per_chunk)]


def npy_rows(uri: str, start: int, end: int) -> np.ndarray:
    """The whole rows stored in bytes [start, end) of a .npy file (the header excluded)."""
    layout = npy_layout(uri)
    if layout is None:
        raise ValueError(f"{uri}: a .npy segment of part of a file that cannot be cut by rows")
    first = max(start, layout.data_offset)
    raw = store.read_bytes(uri, first, end) if end > first else b""
    rows = len(raw) // layout.row_bytes if layout.row_bytes else 0
    return np.frombuffer(raw, dtype=layout.dtype, count=rows * math.prod(layout.shape[1:])).reshape(
        rows, *layout.shape[1:]
    )
