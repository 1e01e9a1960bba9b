"""A chunk's records to named, fixed-shape arrays by the user's preprocess (data.preprocess).

    def preprocess(records: list[dict]) -> dict[str, np.ndarray]:
        ...   # e.g. {"pixels": float32 [N, 1, 8, 8], "label": int64 [N]}

It is called on batches of records (RECORDS_PER_CALL) and may return fewer rows than it got (it
filters) or more (it augments). Every batch, every chunk and every data worker must give the same
columns with the same dtypes and row shapes: the shard's schema, checked here per chunk and by the
coordinator across chunks. `columns` is a built-in preprocess that stacks every numeric field
as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from diloco.data.samples import iter_records
from diloco.data.shard import column_schema
from diloco.data.types import ChunkSpec, RecordStats
from diloco.errors import DilocoError

RECORDS_PER_CALL = 512


class PreprocessError(DilocoError):
    """A preprocess that broke the contract: not a dict of arrays, ragged, or another schema."""


@dataclass
class ProcessedSamples:
    columns: dict[str, np.ndarray]
    stats: RecordStats
    bytes_in: int

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


def columns(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The built-in preprocess: every field whose values are numbers or arrays, stacked as they
    are (strings and other fields are left out)."""
    out: dict[str, np.ndarray] = {}
    for name in records[0] if records else ():
        values = [r.get(name) for r in records]
        if all(isinstance(v, int | float | bool | np.number | np.ndarray) for v in values):
            out[name] = np.stack([np.asarray(v) for v in values])
    return out


def check_arrays(out: Any, where: str, schema: list[dict] | None) -> dict[str, np.ndarray]:
    """The preprocess's output as arrays, refused with one line when it breaks the contract."""
    if not isinstance(out, dict) or not out:
        raise PreprocessError(f"{where} returned {type(out).__name__}, not a dict of arrays")
    arrays: dict[str, np.ndarray] = {}
    for name, value in out.items():
        try:
            array = np.asarray(value)
        except ValueError as e:  # numpy refuses ragged nested lists
            raise PreprocessError(f"{where}: column {name!r} is ragged ({e})") from e
        if array.dtype.kind not in "biuf" or array.ndim == 0:
            raise PreprocessError(
                f"{where}: column {name!r} is {array.dtype} of shape {array.shape}: not a "
                "fixed-shape array of numbers (ragged rows, strings or a scalar)"
            )
        arrays[str(name)] = array
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise PreprocessError(f"{where}: columns have different row counts {lengths}")
    got = column_schema(arrays)
    if schema is not None and got != schema:
        raise PreprocessError(f"{where}: columns changed between batches: {schema_difference(schema, got)}")
    return arrays


def schema_difference(expected: list[dict], got: list[dict]) -> str:
    """One line naming how two schemas differ."""
    want = {c["name"]: (c["dtype"], tuple(c["shape"])) for c in expected}
    have = {c["name"]: (c["dtype"], tuple(c["shape"])) for c in got}
    parts = [f"missing {sorted(set(want) - set(have))}" if set(want) - set(have) else ""]
    parts.append(f"unexpected {sorted(set(have) - set(want))}" if set(have) - set(want) else "")
    parts += [
        f"{n}: {have[n][0]}{list(have[n][1])} vs {want[n][0]}{list(want[n][1])}"
        for n in want
        if n in have and have[n] != want[n]
    ]
    return "; ".join(p for p in parts if p) or "column order differs"


def process_samples(
    chunk: ChunkSpec, fn: Callable[..., Any], name: str, *, classes: list[str], max_record_bytes: int
) -> ProcessedSamples:
    """Read every record of the chunk, preprocess them in batches, shuffle the rows once (seeded
    by the chunk, as packed token rows are)."""
    stats = RecordStats()
    records = (
        r
        for s in chunk.segments
        for r in iter_records(s, stats, classes=classes, max_record_bytes=max_record_bytes)
    )
    parts: list[dict[str, np.ndarray]] = []
    schema: list[dict] | None = None
    for batch in _batches(records, RECORDS_PER_CALL):
        arrays = check_arrays(fn(batch), f"data.preprocess {name}", schema)
        schema = schema or column_schema(arrays)  # every later batch is checked against the first
        parts.append(arrays)
    if not parts:
        raise PreprocessError(f"chunk {chunk.index}: no records to preprocess ({stats.as_dict()})")
    joined = {column: np.concatenate([p[column] for p in parts]) for column in parts[0]}
    order = np.random.default_rng(chunk.index).permutation(len(next(iter(joined.values()))))
    return ProcessedSamples({c: a[order] for c, a in joined.items()}, stats, chunk.nbytes)


def _batches(items: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
