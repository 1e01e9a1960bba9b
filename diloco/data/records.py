"""A raw segment to texts: one piece for plain text files, one record per line for JSONL.

Bad input never stops a chunk: each kind of bad record is counted and skipped, so the data
worker can report it and the run goes on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from diloco import store
from diloco.corpus import file_kind
from diloco.data.chunks import Segment


@dataclass
class RecordStats:
    records: int = 0  # texts yielded
    skipped_undecodable: int = 0  # JSONL lines that are not UTF-8
    skipped_missing_field: int = 0  # JSON objects without a string text field
    skipped_not_json: int = 0  # lines that are not a JSON object
    skipped_empty: int = 0  # empty texts
    # Plain text segments with invalid UTF-8: kept, with U+FFFD for the bad bytes (dropping a
    # whole multi-megabyte segment for one stray byte would lose far more than it protects).
    replaced_undecodable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: RecordStats) -> None:
        for key, value in other.as_dict().items():
            setattr(self, key, getattr(self, key) + value)


def iter_documents(segment: Segment, text_field: str, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pairs of one segment; counts into `stats`."""
    kind = file_kind(segment.uri)
    if kind is None:
        raise ValueError(f"unsupported file kind: {segment.uri}")
    data = store.read_bytes(segment.uri, segment.start, segment.end)
    if kind == "jsonl":
        yield from _jsonl_texts(data, text_field, stats)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        stats.replaced_undecodable += 1
    if not text:
        stats.skipped_empty += 1
        return
    stats.records += 1
    yield text, segment.file_end


def _jsonl_texts(data: bytes, text_field: str, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    # Segments are cut just after a newline, so every line here is a whole record.
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            stats.skipped_undecodable += 1
            continue
        except (ValueError, RecursionError):
            stats.skipped_not_json += 1
            continue
        if not isinstance(obj, dict):
            stats.skipped_not_json += 1
            continue
        text = obj.get(text_field)
        if not isinstance(text, str):
            stats.skipped_missing_field += 1
            continue
        if not text:
            stats.skipped_empty += 1
            continue
        stats.records += 1
        yield text, True
