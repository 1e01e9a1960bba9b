"""Pack token streams into fixed-length training rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import DTypeLike


def pack_rows(
    documents: Iterable[Sequence[int] | np.ndarray], seq_len: int, dtype: DTypeLike
) -> tuple[np.ndarray, int]:
    """Concatenate documents and cut non-overlapping rows of seq_len + 1 tokens.

    A row holds seq_len + 1 tokens so inputs/targets are row[:-1]/row[1:]. Returns the rows
    [n, seq_len + 1] and how many tail tokens did not fill a last row (dropped).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    width = seq_len + 1
    dtype = np.dtype(dtype)
    # One conversion per document and one concatenate; fromiter is the fastest path from a list
    # and, like asarray, refuses ids that do not fit the dtype (OverflowError).
    parts = [
        doc.astype(dtype, copy=False) if isinstance(doc, np.ndarray) else np.fromiter(doc, dtype, len(doc))
        for doc in documents
    ]
    stream = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    n_rows = len(stream) // width
    rows = stream[: n_rows * width].reshape(n_rows, width)
    return rows, len(stream) - n_rows * width
