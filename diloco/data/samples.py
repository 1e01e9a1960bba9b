"""A raw segment to records, for a preprocess (data.preprocess): one dict per sample.

    .jsonl            each line's JSON object
    .csv              each line as {header column: value}, numbers parsed (int, then float; an
                      empty cell stays ""); a row with more or fewer fields than the header is
                      skipped and counted (skipped_ragged_row)
    .parquet          each row as {column: value}, every column of the segment's row groups
    .npy / .npz       each row: {"array": row} / {name: row of each array}
    .png .jpg .jpeg   {"image": uint8 [H, W] or [H, W, C], "label": class index, "class": folder
                      name, "path": uri}: the ImageFolder convention, one folder per class
    .txt .md .py      {"text": the file's text}

Bad records are counted and skipped as the text reader does; a file that cannot be decoded at
all (a damaged image, an unreadable array) fails the chunk (retried, then quarantined).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import Any

import numpy as np

from diloco import store
from diloco.corpus import file_kind
from diloco.data.arrays import npy_rows
from diloco.data.records import decoded_blocks, iter_documents, jsonl_objects, record_lines
from diloco.data.types import RecordStats, Segment
from diloco.errors import DilocoError


def iter_records(
    segment: Segment, stats: RecordStats, *, classes: list[str], max_record_bytes: int
) -> Iterator[dict[str, Any]]:
    kind = file_kind(segment.uri)
    if kind == "parquet":
        yield from _parquet_records(segment, stats)
    elif kind == "jsonl":
        yield from _jsonl_records(segment, stats, max_record_bytes)
    elif kind == "csv":
        yield from _csv_records(segment, stats, max_record_bytes)
    elif kind in ("npy", "npz"):
        yield from _array_records(segment, kind, stats)
    elif kind == "image":
        yield _image_record(segment.uri, classes, stats)
    elif kind == "text":
        for text, _ in iter_documents(segment, "text", stats, max_record_bytes):
            yield {"text": text}
    else:
        raise ValueError(f"unsupported file kind: {segment.uri}")


def image_classes(files: list[str]) -> list[str]:
    """The class names of an image dataset: its image files' folder names, sorted (a label is
    the index of its folder's name here, the same on every data worker)."""
    return sorted({_folder(f) for f in files if file_kind(f) == "image"})


def _folder(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 2)[-2] if uri.count("/") >= 1 else ""


def _jsonl_records(segment: Segment, stats: RecordStats, max_bytes: int) -> Iterator[dict[str, Any]]:
    for obj in jsonl_objects(record_lines(decoded_blocks(segment, stats), max_bytes, stats), stats):
        stats.records += 1
        yield obj


def _csv_header(uri: str) -> list[str]:
    """The first line of the file: a segment cut further in still needs the column names."""
    first = next(
        record_lines(
            decoded_blocks(Segment(uri, 0, store.size(uri), True), RecordStats()), 1 << 20, RecordStats()
        ),
        b"",
    )
    return next(csv.reader([first.decode("utf-8", errors="replace")]), [])


def _csv_records(segment: Segment, stats: RecordStats, max_bytes: int) -> Iterator[dict[str, Any]]:
    header = _csv_header(segment.uri)
    lines = record_lines(decoded_blocks(segment, stats), max_bytes, stats)
    if segment.start == 0:
        next(lines, None)  # the header itself
    # csv.reader over the lines, each with its newline back: a quoted field may span lines (the
    # segments are cut only between records, see diloco.data.chunks.csv_cuts).
    for values in csv.reader(_decoded_lines(lines, stats)):
        if not values:
            continue
        if len(values) != len(header):  # a field more or fewer than the header names
            stats.skipped_ragged_row += 1
            continue
        stats.records += 1
        yield {name: _number(v) for name, v in zip(header, values, strict=True)}


def _decoded_lines(lines: Iterator[bytes], stats: RecordStats) -> Iterator[str]:
    for line in lines:
        try:
            yield line.decode("utf-8") + "\n"
        except UnicodeDecodeError:
            stats.skipped_undecodable += 1


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _parquet_records(segment: Segment, stats: RecordStats) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    with store.open_read(segment.uri) as f:
        pf = pq.ParquetFile(f)
        groups = list(range(segment.start, min(segment.end, pf.num_row_groups)))
        for batch in pf.iter_batches(batch_size=256, row_groups=groups):
            for row in batch.to_pylist():
                stats.records += 1
                yield row


def _array_records(segment: Segment, kind: str, stats: RecordStats) -> Iterator[dict[str, Any]]:
    # allow_pickle stays off: a .npy/.npz of objects is refused, never unpickled.
    if kind == "npy" and (segment.start > 0 or not segment.file_end):
        arrays = {"array": npy_rows(segment.uri, segment.start, segment.end)}  # a cut: some rows
    else:
        loaded = np.load(io.BytesIO(store.read_bytes(segment.uri)), allow_pickle=False)
        arrays = {"array": loaded} if kind == "npy" else {name: loaded[name] for name in loaded.files}
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{segment.uri}: arrays of different lengths {lengths}")
    for i in range(min(lengths.values(), default=0)):
        stats.records += 1
        yield {name: a[i] for name, a in arrays.items()}


def _image_record(uri: str, classes: list[str], stats: RecordStats) -> dict[str, Any]:
    from PIL import Image  # pip install "diloco[images]": only image datasets need it

    with Image.open(io.BytesIO(store.read_bytes(uri))) as image:
        pixels = np.asarray(image.convert("RGB") if image.mode not in ("L", "RGB") else image)
    folder = _folder(uri)
    if folder not in classes:  # a folder the run did not start with: no label means it
        shown = ", ".join(classes[:8]) + (", …" if len(classes) > 8 else "")
        raise DilocoError(f"{uri}: its class folder {folder!r} is not one of the run's classes ({shown})")
    stats.records += 1
    return {"image": pixels, "label": classes.index(folder), "class": folder, "path": uri}
