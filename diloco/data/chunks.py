"""Partition a dataset's files into chunks: the unit a data worker leases and turns into a shard.

Small files are grouped into one chunk up to about `chunk_bytes`; a larger file is cut into byte
ranges that end just after a newline, found by reading a small window after each target offset,
so partitioning a terabyte costs a few stat calls and kilobytes of reads, not a full scan (a CSV
file is read once: only the quotes before a newline say whether it ends a record; a .npy file is
cut between rows, from its header).
A compressed file (.gz, .zst) cannot be cut by byte offset: it is one segment of its own. A
parquet file is cut by row group, from its footer alone: a segment holds a range of row groups
(small ones grouped up to about `chunk_bytes` of the text column's compressed bytes).
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass

from diloco import store
from diloco.corpus import file_kind, is_splittable
from diloco.data.arrays import npy_cuts
from diloco.data.records import decoded_blocks
from diloco.data.types import UNIT_BYTES, UNIT_ROW_GROUPS, ChunkSpec, RecordStats, Segment

__all__ = ["UNIT_BYTES", "UNIT_ROW_GROUPS", "ChunkSpec", "Segment", "partition", "partition_dataset"]

log = logging.getLogger("diloco.data")

# First window read after a cut target when looking for a newline; doubled until one is found.
_WINDOW = 4096
_MAX_WINDOW = 1 << 20


def find_cut(uri: str, target: int, size: int) -> int:
    """The offset just after the first newline at or after byte `target - 1`; `size` if none.

    So a cut at `target` is kept when the byte before it already ends a line.
    """
    pos, window = max(target - 1, 0), _WINDOW
    while pos < size:
        data = store.read_bytes(uri, pos, min(pos + window, size))
        if not data:
            break
        nl = data.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(data)
        window = min(window * 2, _MAX_WINDOW)
    return size  # a record longer than the rest of the file: keep it whole


def file_segments(uri: str, size: int, chunk_bytes: int) -> list[Segment]:
    """One file as segments of at least `chunk_bytes` (the last may be shorter), cut after newlines
    (in a CSV file, only after newlines that end a record)."""
    if size <= chunk_bytes or not is_splittable(uri):
        return [Segment(uri, 0, size, True)]
    kind = file_kind(uri)
    if kind in ("csv", "npy"):
        cuts = csv_cuts(uri, size, chunk_bytes) if kind == "csv" else npy_cuts(uri, size, chunk_bytes)
        bounds = [0, *cuts, size]
        return [Segment(uri, a, b, b == size) for a, b in zip(bounds, bounds[1:], strict=False)]
    segments: list[Segment] = []
    start = 0
    while start < size:
        end = size if size - start <= chunk_bytes else find_cut(uri, start + chunk_bytes, size)
        segments.append(Segment(uri, start, end, end == size))
        start = end
    return segments


_QUOTE_OR_NEWLINE = re.compile(rb'["\n]')


def csv_cuts(uri: str, size: int, chunk_bytes: int) -> list[int]:
    """Where a CSV file may be cut, one pass over it: just after the first newline at or after
    each target that is outside quotes. A quoted field may hold newlines, and a quote inside one
    is doubled (RFC 4180), so a byte is inside quotes exactly when an odd number of quote
    characters comes before it in the file."""
    cuts: list[int] = []
    quotes, offset, start = 0, 0, 0
    for block in decoded_blocks(Segment(uri, 0, size, True), RecordStats()):
        i = 0
        while size - start > chunk_bytes:
            j = max(i, start + chunk_bytes - 1 - offset)  # where the search for the next cut begins
            if j >= len(block):
                break
            quotes += block.count(b'"', i, j)
            i = len(block)
            for m in _QUOTE_OR_NEWLINE.finditer(block, j):
                if m.group() == b'"':
                    quotes += 1
                elif quotes % 2 == 0:
                    start = offset + m.end()
                    cuts.append(start)
                    i = m.end()
                    break
            else:
                break
        quotes += block.count(b'"', i)
        offset += len(block)
    return [c for c in cuts if c < size]


def parquet_segments(uri: str, chunk_bytes: int, text_field: str) -> list[Segment]:
    """A parquet file as ranges of row groups, read from its footer alone (never its data).

    Consecutive row groups are grouped while their size stays within `chunk_bytes` (one larger
    than that is a segment of its own); a row group's size is the compressed size of its
    `text_field` column, the bytes a data worker will read, or of all its columns when there is
    no such column. No segments for a file without rows.
    """
    sizes = row_group_sizes(uri, text_field)
    if not sizes:
        return []
    segments: list[Segment] = []
    start, acc = 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and acc + nbytes > chunk_bytes:
            segments.append(Segment(uri, start, i, False, UNIT_ROW_GROUPS, acc))
            start, acc = i, 0
        acc += nbytes
    segments.append(Segment(uri, start, len(sizes), True, UNIT_ROW_GROUPS, acc))
    return segments


def row_group_sizes(uri: str, text_field: str) -> list[int]:
    """Per row group, the compressed bytes of its `text_field` column (all columns if absent).

    Empty when the file has no rows. Reads only the footer.
    """
    import pyarrow.parquet as pq

    with store.open_read(uri) as f:
        meta = pq.read_metadata(f)
    if meta.num_rows == 0:
        return []
    sizes = []
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        columns = [group.column(j) for j in range(group.num_columns)]
        text = [c.total_compressed_size for c in columns if c.path_in_schema == text_field]
        sizes.append(max(1, sum(text) if text else sum(c.total_compressed_size for c in columns)))
    return sizes


def whole_file_segment(uri: str, text_field: str = "text") -> Segment | None:
    """All of one file as a single segment (every row group of a parquet file); None when empty."""
    if file_kind(uri) == "parquet":
        sizes = row_group_sizes(uri, text_field)
        return Segment(uri, 0, len(sizes), True, UNIT_ROW_GROUPS, sum(sizes)) if sizes else None
    size = store.size(uri)
    return Segment(uri, 0, size, True) if size else None


def mixed_order(files: list[str], seed: int) -> list[str]:
    """The files in a seeded random order. Samples are often laid out by class (one folder per
    class, the ImageFolder convention): chunks of neighbouring files would each hold one class, and
    H steps on one class, or a held-out split of one class, teach nothing."""
    order = sorted(files)
    random.Random(seed).shuffle(order)
    return order


def lease_positions(n_chunks: int, shuffle_seed: int | None) -> list[int]:
    """Chunk i's place in the order chunks (and their shards) are handed out: a seeded random
    order, or the dataset's own without a seed. The ledger records it; a baseline that should
    train on the rows a run trains on (benchmarks/ddp_baseline.py) takes chunks in it too."""
    order = list(range(n_chunks))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    return order


def eval_indices(n_chunks: int, eval_fraction: float) -> set[int]:
    """About `eval_fraction` of chunk indices, evenly spread; at least one when there are two chunks."""
    if eval_fraction <= 0 or n_chunks < 2:
        return set()
    n_eval = min(max(1, round(n_chunks * eval_fraction)), n_chunks - 1)
    # Centre of each of n_eval equal strides: spread over the corpus, never all at one end.
    return {int((i + 0.5) * n_chunks / n_eval) for i in range(n_eval)}


@dataclass
class Partition:
    chunks: list[ChunkSpec]
    # Files that held nothing (empty_files) or whose parquet footer is unreadable (unreadable_files).
    stats: RecordStats


def partition_dataset(
    files: list[str], chunk_bytes: int, eval_fraction: float, text_field: str = "text", epochs: int = 1
) -> Partition:
    """Deterministic chunks covering every byte (or row group) of every non-empty file exactly once,
    and with `epochs` > 1 every train chunk that many times: each copy is a chunk of its own (made
    into its own shard, its rows shuffled by its own index), so exactly-once holds per copy.

    Empty files, and parquet files whose footer cannot be read, are left out and counted.
    """

    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    stats = RecordStats()
    groups: list[list[Segment]] = []
    current: list[Segment] = []
    current_bytes = 0
    for uri in files:
        size = store.size(uri)
        if size == 0:
            stats.empty_files += 1
            continue
        if file_kind(uri) == "parquet":
            import pyarrow as pa

            try:
                segments = parquet_segments(uri, chunk_bytes, text_field)
            except pa.ArrowInvalid as e:  # not parquet, or a damaged footer: nothing to read
                log.warning("skipping %s: not a readable parquet file: %s", uri, e)
                stats.unreadable_files += 1
                continue
            if not segments:
                stats.empty_files += 1
                continue
        else:
            segments = file_segments(uri, size, chunk_bytes)
        for seg in segments:
            if current and current_bytes + seg.nbytes > chunk_bytes:
                groups.append(current)
                current, current_bytes = [], 0
            current.append(seg)
            current_bytes += seg.nbytes
    if current:
        groups.append(current)
    held_out = eval_indices(len(groups), eval_fraction)
    chunks = [
        ChunkSpec(index=i, segments=tuple(g), split="eval" if i in held_out else "train")
        for i, g in enumerate(groups)
    ]
    train = [c for c in chunks if c.split == "train"]
    for _ in range(1, epochs):
        chunks += [ChunkSpec(len(chunks) + k, c.segments, "train") for k, c in enumerate(train)]
    return Partition(chunks, stats)


def partition(
    files: list[str], chunk_bytes: int, eval_fraction: float, text_field: str = "text"
) -> list[ChunkSpec]:
    """The chunks of partition_dataset, without its counts of skipped files."""
    return partition_dataset(files, chunk_bytes, eval_fraction, text_field).chunks
