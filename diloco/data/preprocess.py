"""A chunk's records to named, fixed-shape arrays by the user's preprocess (data.preprocess).

    def preprocess(records: list[dict]) -> dict[str, np.ndarray]:
        ...   # e.g. {"pixels": float32 [N, 1, 8, 8], "label": int64 [N]}

It is called on batches of records (RECORDS_PER_CALL) and may return fewer rows than it got (it
filters) or more (it augments). Every batch, every chunk and every data worker must give the same
columns with the same dtypes and row shapes: the shard's schema, checked here per chunk and by the
coordinator across chunks. `columns` is a built-in preprocess that stacks every numeric field
(floats as float32, integers as int64).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

import numpy as np

from diloco.data.samples import iter_records
from diloco.data.shard import column_schema
from diloco.data.types import UNIT_ROW_GROUPS, ChunkSpec, RecordStats, Segment
from diloco.errors import DilocoError

RECORDS_PER_CALL = 512

T = TypeVar("T")


class PreprocessError(DilocoError):
    """A preprocess that broke the contract (not a dict of arrays, ragged, another schema) or raised."""


class MissingValue(PreprocessError):
    """`columns` met a field that is a number in some records and missing or text in another:
    dropping the field would change the shard's columns from one batch or chunk to the next."""

    def __init__(self, column: str, value: Any, row: int, *, everywhere: bool = False):
        others = "no other record of its batch has a value" if everywhere else "numeric in other records"
        super().__init__(
            f"column {column!r} is {value!r} in this record ({others}): fill in or drop the missing "
            "values, or write a preprocess that does (data.preprocess)"
        )
        self.row = row  # the record's index in the batch, for process_samples to name its file


# Cells that mean "no value" (pandas writes an empty cell; R and others write NA).
MISSING_TEXT = frozenset({"", "na", "n/a", "nan", "null", "none"})


@dataclass
class ProcessedSamples:
    columns: dict[str, np.ndarray]
    stats: RecordStats
    bytes_in: int

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


def columns(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The built-in preprocess: every field whose values are numbers or arrays, stacked (floats as
    float32, what a model's weights are; integers as int64). A field that is text in every record
    (a name) is left out; one that is a number in some records and missing or text in another is
    refused (MissingValue), never dropped: its column would then come and go between batches."""
    out: dict[str, np.ndarray] = {}
    for name in records[0] if records else ():
        values = [r.get(name) for r in records]
        numeric = [_is_number(v) for v in values]
        if all(numeric):
            out[name] = _float32(np.stack([np.asarray(v) for v in values]))
            continue
        if any(numeric):
            row = numeric.index(False)
            raise MissingValue(name, values[row], row)
        if all(_is_missing(v) for v in values):
            # Empty in this batch only, or in the whole file? Dropping it could change the schema.
            raise MissingValue(name, values[0], 0, everywhere=True)
    return out


def _is_number(value: Any) -> bool:
    if isinstance(value, float | np.floating) and np.isnan(value):
        return False  # a NaN cell is a missing value, not a feature to train on
    return isinstance(value, int | float | bool | np.number | np.ndarray)


def _is_missing(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in MISSING_TEXT
    return value is None or (isinstance(value, float | np.floating) and bool(np.isnan(value)))


def _float32(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if array.dtype == np.float64 else array


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
    where = f"data.preprocess {name}"
    located = (
        (record, (segment, k))
        for segment in chunk.segments
        for k, record in enumerate(
            iter_records(segment, stats, classes=classes, max_record_bytes=max_record_bytes)
        )
    )
    parts: list[dict[str, np.ndarray]] = []
    schema: list[dict] | None = None
    for batch in _batches(located, RECORDS_PER_CALL):
        try:
            out = fn([record for record, _ in batch])
        except MissingValue as e:  # the built-in's row is the batch's; another's may be a subset's
            place = f" ({record_place(*batch[e.row][1])})" if fn is columns else ""
            raise PreprocessError(f"{where}: {e}{place}") from e
        except Exception as e:  # the user's code: the line names the function, the chunk fails
            raise PreprocessError(f"{where} raised {type(e).__name__}: {e}") from e
        arrays = check_arrays(out, where, schema)
        schema = schema or column_schema(arrays)  # every later batch is checked against the first
        parts.append(arrays)
    if not parts:
        raise PreprocessError(f"chunk {chunk.index}: no records to preprocess ({stats.as_dict()})")
    joined = {column: np.concatenate([p[column] for p in parts]) for column in parts[0]}
    order = np.random.default_rng(chunk.index).permutation(len(next(iter(joined.values()))))
    return ProcessedSamples({c: a[order] for c, a in joined.items()}, stats, chunk.nbytes)


def record_place(segment: Segment, k: int) -> str:
    """Where the k-th record read from a segment is, for a person to find it: in a file read from
    its start, its data row (a CSV file's line k + 2, after the header, unless quoted fields span
    lines); in a part cut further in, the row counted from the cut."""
    if segment.start == 0:
        return f"{segment.uri}, record {k + 1}"
    unit = "row group" if segment.unit == UNIT_ROW_GROUPS else "byte"
    return f"{segment.uri}, record {k + 1} from {unit} {segment.start}"


def _batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
