"""The data plane's plain types: a dataset's segments and chunks, and the counts of bad records.

A module of their own, so partitioning (chunks) and reading (records) both use them without
importing each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# What a segment's [start, end) counts: bytes of the file, or parquet row groups.
UNIT_BYTES = "bytes"
UNIT_ROW_GROUPS = "row_groups"


@dataclass(frozen=True)
class Segment:
    """The byte range [start, end) of one file; `file_end` when `end` is the file's size.

    With unit "row_groups", [start, end) are the parquet row groups of the file instead, and
    `size` the stored bytes they hold (what sizes chunks; a byte range's size is end - start).
    """

    uri: str
    start: int
    end: int
    file_end: bool
    unit: str = UNIT_BYTES
    size: int = 0

    @property
    def nbytes(self) -> int:
        return self.size if self.unit == UNIT_ROW_GROUPS else self.end - self.start

    def to_list(self) -> list:
        base = [self.uri, self.start, self.end, self.file_end]
        return base if self.unit == UNIT_BYTES else [*base, self.unit, self.size]

    @classmethod
    def from_list(cls, item: list) -> Segment:
        if len(item) == 4:
            uri, start, end, file_end = item
            return cls(str(uri), int(start), int(end), bool(file_end))
        uri, start, end, file_end, unit, size = item
        if unit not in (UNIT_BYTES, UNIT_ROW_GROUPS) or int(size) < 0:
            raise ValueError(f"unit={unit!r} size={size!r}")
        return cls(str(uri), int(start), int(end), bool(file_end), str(unit), int(size))


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
                "segments": [s.to_list() for s in self.segments],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> ChunkSpec:
        try:
            obj = json.loads(text)
            index, split = obj["index"], obj["split"]
            segments = tuple(Segment.from_list(item) for item in obj["segments"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a chunk spec: {e}") from e
        if not isinstance(index, int) or split not in ("train", "eval"):
            raise ValueError(f"not a chunk spec: index={index!r} split={split!r}")
        if any(s.start < 0 or s.end <= s.start for s in segments):
            raise ValueError("not a chunk spec: a segment is empty or negative")
        return cls(index=index, segments=segments, split=split)


@dataclass
class RecordStats:
    records: int = 0  # texts yielded
    skipped_undecodable: int = 0  # JSONL lines or parquet binary values that are not UTF-8
    # JSONL objects and parquet rows without a string text field (missing, null or another type).
    skipped_missing_field: int = 0
    skipped_not_json: int = 0  # lines that are not a JSON object
    # CSV rows with more or fewer fields than the header (once counted as skipped_missing_field,
    # which sent users looking for a missing column; a row with an extra field misses nothing).
    skipped_ragged_row: int = 0
    skipped_empty: int = 0  # empty texts
    skipped_oversized: int = 0  # JSONL lines or parquet values over data.max_record_bytes
    # Plain text pieces with invalid UTF-8: kept, with U+FFFD for the bad bytes (dropping a
    # whole multi-megabyte segment for one stray byte would lose far more than it protects).
    replaced_undecodable: int = 0
    # Compressed files that end early or are damaged: what was decoded before is kept.
    truncated_compressed: int = 0
    # Counted once, when the coordinator partitions the dataset: files without any data, and
    # parquet files whose footer cannot be read (both left out of every chunk).
    empty_files: int = 0
    unreadable_files: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: RecordStats) -> None:
        for key, value in other.as_dict().items():
            setattr(self, key, getattr(self, key) + value)
