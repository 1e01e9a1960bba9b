"""Whether a dataset's records hold the text field (data.text_field).

A record without it is skipped and counted: a few such records never stop a run. A file or a
chunk of which *every* record lacks it is another thing: the field is misnamed and nothing
trains, so it is said at once, in one line, with the fields the records do have. The coordinator
peeks at the first records of the dataset's first files when it lists them (a dataset whose every
record lacks the field is refused before anything starts); a data worker fails a chunk whose every
record lacks it, with the same line.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from diloco import store
from diloco.corpus import file_kind
from diloco.data.records import decoded_blocks, jsonl_objects, record_lines
from diloco.data.types import UNIT_BYTES, UNIT_ROW_GROUPS, RecordStats, Segment
from diloco.errors import DilocoError

log = logging.getLogger("diloco.data")

# What the coordinator reads when it lists a dataset: a good file stops at its first record with the
# field; only a file without one is read further, up to this many decoded bytes.
PEEK_FILES = 16
PEEK_BYTES = 8 << 20
SHOWN_FIELDS = 6
SHOWN_FILES = 3


class MissingTextField(DilocoError):
    """Every record of a chunk or of the dataset lacks data.text_field: nothing would train."""


def missing_field_message(where: str, text_field: str, found: Counter[str]) -> str:
    """The one line: what lacks the field, the key to set, and the fields the records have."""
    names = [name for name, _ in found.most_common(SHOWN_FIELDS)]
    more = ", …" if len(found) > SHOWN_FIELDS else ""
    # A field of that name whose values are not text (numbers, null) is no text field either.
    what = f"a string field {text_field!r}" if text_field in found else f"field {text_field!r}"
    return (
        f"every record of {where} lacks {what}; set data.text_field "
        f"(found fields: {', '.join(names) or 'none'}{more})"
    )


@dataclass
class FieldPeek:
    """What the first records of one file (or segment) say about the text field."""

    uri: str
    records: int = 0  # records looked at (JSON objects, parquet rows)
    with_field: int = 0  # of them, those with a string text field (the peek stops at the first)
    fields: Counter[str] = field(default_factory=Counter)  # the fields of those without it
    whole: bool = False  # every record was looked at

    @property
    def lacks(self) -> bool:
        return self.records > 0 and self.with_field == 0


def peek_segment(segment: Segment, text_field: str, max_bytes: int | None = None) -> FieldPeek | None:
    """The text field in the first records of a JSONL or parquet segment; None for other kinds
    (plain text has no fields) and for a file that cannot be read here (the worker's to report)."""
    try:
        kind = file_kind(segment.uri)
        if kind == "parquet":
            return _parquet_peek(segment.uri, text_field)
        return _jsonl_peek(segment, text_field, max_bytes or PEEK_BYTES) if kind == "jsonl" else None
    except (OSError, ValueError) as e:
        log.debug("cannot peek at %s: %s", segment.uri, e)
        return None


def peek_file(uri: str, text_field: str, max_bytes: int | None = None) -> FieldPeek | None:
    try:
        size = store.size(uri)
    except OSError:
        return None
    unit = UNIT_ROW_GROUPS if file_kind(uri) == "parquet" else UNIT_BYTES
    return peek_segment(Segment(uri, 0, max(size, 1), True, unit), text_field, max_bytes)


def _files(uris: list[str]) -> str:
    """Several files, named as far as a line allows."""
    shown = ", ".join(uris[:SHOWN_FILES]) + (", …" if len(uris) > SHOWN_FILES else "")
    return f"{len(uris)} files ({shown})"


def _part(segment: Segment) -> str:
    """A segment as a user finds it: its file, or the part of it a chunk holds."""
    if segment.start == 0 and segment.file_end:
        return segment.uri
    unit = "row groups" if segment.unit == UNIT_ROW_GROUPS else "bytes"
    return f"{segment.uri} ({unit} {segment.start}-{segment.end})"


def _parquet_peek(uri: str, text_field: str) -> FieldPeek:
    import pyarrow.parquet as pq

    with store.open_read(uri) as f:
        meta = pq.read_metadata(f)
    names = meta.schema.to_arrow_schema().names
    if text_field in names:  # whether its values are strings is the worker's to count
        return FieldPeek(uri, meta.num_rows, meta.num_rows)
    return FieldPeek(uri, meta.num_rows, 0, Counter(names), whole=True)


def _jsonl_peek(segment: Segment, text_field: str, max_bytes: int) -> FieldPeek:
    peek = FieldPeek(segment.uri)
    stats = RecordStats()
    blocks = _first_bytes(decoded_blocks(segment, stats), max_bytes, peek)
    with contextlib.closing(blocks):  # a peek that stops early lets go of the file at once
        for obj in jsonl_objects(record_lines(blocks, max_bytes, stats), stats):
            peek.records += 1
            if isinstance(obj.get(text_field), str):
                peek.with_field += 1
                break
            peek.fields.update(obj.keys())
    return peek


def _first_bytes(blocks: Iterable[bytes], limit: int, peek: FieldPeek) -> Iterator[bytes]:
    """The stream's blocks until `limit` bytes are read; `peek.whole` once it ended within them."""
    seen = 0
    for block in blocks:
        if seen >= limit:
            return
        seen += len(block)
        yield block
    peek.whole = True


def check_dataset_field(files: list[str], text_field: str) -> None:
    """At listing: refuse a dataset whose every record lacks the text field (MissingTextField),
    and warn of each of its first files whose first records all lack it. Only certain knowledge
    refuses: every file read whole (or a parquet schema without the column), none holding text."""
    peeks = [peek_file(uri, text_field) for uri in files[:PEEK_FILES]]
    lacking = [p for p in peeks if p is not None and p.lacks]
    if not lacking:
        return
    found = sum((p.fields for p in lacking), Counter())
    nothing_trains = len(files) <= PEEK_FILES and all(
        p is not None and p.whole and (p.lacks or p.records == 0) for p in peeks
    )
    if nothing_trains:
        where = lacking[0].uri if len(lacking) == 1 else f"the dataset's {_files([p.uri for p in lacking])}"
        raise MissingTextField(missing_field_message(where, text_field, found))
    for p in lacking[:SHOWN_FILES]:
        if p.whole:
            log.warning("%s; its records are skipped", missing_field_message(p.uri, text_field, p.fields))
        else:
            log.warning(
                "the first %d records of %s lack field %r; set data.text_field if the text is under another "
                "field (found fields: %s)", p.records, p.uri, text_field, ", ".join(sorted(p.fields)),
            )  # fmt: skip


def check_chunk_field(segments: Iterable[Segment], stats: RecordStats, text_field: str) -> None:
    """After a chunk is read: refuse it (MissingTextField) when it held records and every one of
    them lacked the text field. A chunk where only some lack it is made as usual (they are counted)."""
    if stats.records or stats.skipped_empty or not stats.skipped_missing_field:
        return
    segments = list(segments)
    found: Counter[str] = Counter()
    for segment in segments[:PEEK_FILES]:  # the fields, from the first records of its first files
        peek = peek_segment(segment, text_field, 1 << 20)
        if peek is not None:
            found.update(peek.fields)
    where = _part(segments[0]) if len(segments) == 1 else f"this chunk's {_files([s.uri for s in segments])}"
    raise MissingTextField(missing_field_message(where, text_field, found))
