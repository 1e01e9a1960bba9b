"""Partition a dataset's files into chunks: the unit a data worker leases and turns into a shard.

Small files are grouped into one chunk up to about `chunk_bytes`; a larger file is cut into byte
ranges that end just after a newline, found by reading a small window after each target offset,
so partitioning a terabyte costs a few stat calls and kilobytes of reads, not a full scan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from diloco import store
from diloco.corpus import is_splittable

# First window read after a cut target when looking for a newline; doubled until one is found.
_WINDOW = 4096
_MAX_WINDOW = 1 << 20


@dataclass(frozen=True)
class Segment:
    """The byte range [start, end) of one file; `file_end` when `end` is the file's size."""

    uri: str
    start: int
    end: int
    file_end: bool

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    segments: tuple[Segment, ...]
    split: str  # "train" | "eval"

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "split": self.split,
                "segments": [[s.uri, s.start, s.end, s.file_end] for s in self.segments],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> ChunkSpec:
        try:
            obj = json.loads(text)
            index, split = obj["index"], obj["split"]
            segments = tuple(Segment(str(u), int(a), int(b), bool(e)) for u, a, b, e in obj["segments"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a chunk spec: {e}") from e
        if not isinstance(index, int) or split not in ("train", "eval"):
            raise ValueError(f"not a chunk spec: index={index!r} split={split!r}")
        if any(s.start < 0 or s.end <= s.start for s in segments):
            raise ValueError("not a chunk spec: a segment is empty or negative")
        return cls(index=index, segments=segments, split=split)


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
    """One file as segments of at least `chunk_bytes` (the last may be shorter), cut after newlines."""
    if size <= chunk_bytes or not is_splittable(uri):
        return [Segment(uri, 0, size, True)]
    segments: list[Segment] = []
    start = 0
    while start < size:
        end = size if size - start <= chunk_bytes else find_cut(uri, start + chunk_bytes, size)
        segments.append(Segment(uri, start, end, end == size))
        start = end
    return segments


def eval_indices(n_chunks: int, eval_fraction: float) -> set[int]:
    """About `eval_fraction` of chunk indices, evenly spread; at least one when there are two chunks."""
    if eval_fraction <= 0 or n_chunks < 2:
        return set()
    n_eval = min(max(1, round(n_chunks * eval_fraction)), n_chunks - 1)
    # Centre of each of n_eval equal strides: spread over the corpus, never all at one end.
    return {int((i + 0.5) * n_chunks / n_eval) for i in range(n_eval)}


def partition(files: list[str], chunk_bytes: int, eval_fraction: float) -> list[ChunkSpec]:
    """Deterministic chunks covering every byte of every non-empty file exactly once, in file order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    groups: list[list[Segment]] = []
    current: list[Segment] = []
    current_bytes = 0
    for uri in files:
        size = store.size(uri)
        if size == 0:
            continue
        for seg in file_segments(uri, size, chunk_bytes):
            if current and current_bytes + seg.nbytes > chunk_bytes:
                groups.append(current)
                current, current_bytes = [], 0
            current.append(seg)
            current_bytes += seg.nbytes
    if current:
        groups.append(current)
    held_out = eval_indices(len(groups), eval_fraction)
    return [
        ChunkSpec(index=i, segments=tuple(g), split="eval" if i in held_out else "train")
        for i, g in enumerate(groups)
    ]
