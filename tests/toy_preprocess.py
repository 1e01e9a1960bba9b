"""Preprocesses as a user would write them, installed where the data workers run (the tests package)."""

from __future__ import annotations

import os

import numpy as np


def rows(records: list[dict]) -> dict[str, np.ndarray]:
    # TOY_PREPROCESS_DTYPE stands for another version of this function on one data worker.
    dtype = os.environ.get("TOY_PREPROCESS_DTYPE", "float32")
    return {
        "x": np.array([[r["a"], r["b"]] for r in records], dtype=dtype),
        "y": np.array([r["a"] % 2 for r in records], dtype=np.int64),
    }


def not_arrays(records: list[dict]) -> list:
    return [r["a"] for r in records]
