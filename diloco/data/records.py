"""A raw segment to texts: pieces of plain text, one record per JSONL line or parquet value.

Every file is read as a stream, a block at a time: a segment's bytes (or a compressed file's
decoded bytes, gzip or zstd) are never held whole, and records are yielded as they are decoded.
Bad input never stops a chunk: each kind of bad record is counted and skipped, so the data
worker can report it and the run goes on. A compressed file that ends early or is damaged keeps
the records decoded before the damage and is counted (`truncated_compressed`), not failed: the
damage is in the file, so retrying (and quarantining after N tries) would only lose those
records too. A store that cannot be read, or a parquet row group that cannot be decoded, fails
the chunk instead (retried, then quarantined by the coordinator).
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterable, Iterator
from typing import IO

import zstandard

from diloco import store
from diloco.corpus import compression, file_kind
from diloco.data.types import RecordStats, Segment

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "RecordStats", "iter_documents"]

log = logging.getLogger("diloco.data")

# Records (JSONL lines, parquet values) larger than this are skipped; data.max_record_bytes.
DEFAULT_MAX_RECORD_BYTES = 8 << 20
# Stored bytes read at a time.
_BLOCK = 1 << 20
# Compressed bytes handed to the zstd decoder at a time: its output per call is bounded by this
# times the format's largest expansion, so a pathological file cannot balloon one call.
_ZSTD_INPUT = 1 << 13
# Plain text goes on to the tokenizer in pieces of about this many bytes, cut after a newline; a
# stretch this many times longer without one is cut at a character boundary.
_TEXT_PIECE = 1 << 20
_LONG_LINE_FACTOR = 4


def iter_documents(
    segment: Segment,
    text_field: str,
    stats: RecordStats,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pairs of one segment; counts into `stats`."""
    kind = file_kind(segment.uri)
    if kind is None:
        raise ValueError(f"unsupported file kind: {segment.uri}")
    if (kind == "parquet") != (segment.unit == "row_groups"):
        raise ValueError(f"a {kind} file cannot be read as a segment of {segment.unit}: {segment.uri}")
    if kind == "parquet":
        yield from _parquet_texts(segment, text_field, max_record_bytes, stats)
    elif kind == "jsonl":
        yield from _jsonl_texts(
            record_lines(decoded_blocks(segment, stats), max_record_bytes, stats), text_field, stats
        )
    else:
        yield from _plain_texts(segment, stats)


# -- bytes --------------------------------------------------------------------------------------


def decoded_blocks(segment: Segment, stats: RecordStats) -> Iterator[bytes]:
    """The segment's bytes, decompressed when the file is, a block at a time."""
    codec = compression(segment.uri)
    if codec is None:
        yield from _raw_blocks(segment)
        return
    # A compressed file is always one whole segment (it cannot be cut by offset).
    with store.open_read(segment.uri) as raw:
        try:
            yield from _gunzip(raw) if codec == "gzip" else _unzstd(raw)
        except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as e:
            # BadGzipFile is an OSError: caught here by name, so a failing store still fails.
            stats.truncated_compressed += 1
            log.warning(
                "%s: compressed data ends early or is damaged; kept what came before: %s", segment.uri, e
            )


def _raw_blocks(segment: Segment) -> Iterator[bytes]:
    with store.open_read(segment.uri) as f:
        f.seek(segment.start)
        left = segment.end - segment.start
        while left > 0:
            data = f.read(min(_BLOCK, left))
            if not data:
                break  # the file is shorter than when it was partitioned
            left -= len(data)
            yield data


def _gunzip(raw: IO[bytes]) -> Iterator[bytes]:
    # Members one after another, as gzip -d reads them. read1, not read: read gathers a whole
    # block first and raises at a truncation without handing over what it had decoded.
    with gzip.GzipFile(fileobj=raw) as f:
        while data := f.read1(_BLOCK):
            yield data


def _unzstd(raw: IO[bytes]) -> Iterator[bytes]:
    """Every frame of a zstd stream; EOFError when the stream ends inside a frame.

    (zstandard's stream reader returns end-of-file quietly on a truncated frame, so frames are
    decoded one by one here to tell a whole file from a cut one.)
    """
    dctx = zstandard.ZstdDecompressor()
    frame, in_frame = dctx.decompressobj(), False
    while data := raw.read(_ZSTD_INPUT):
        while data:
            out = frame.decompress(data)
            in_frame = True
            if out:
                yield out
            if frame.eof:  # a frame ended inside this input: the rest starts the next one
                data, frame, in_frame = frame.unused_data, dctx.decompressobj(), False
            else:
                data = b""
    if in_frame:
        raise EOFError("zstd data ends inside a frame")


# -- plain text ---------------------------------------------------------------------------------


def _text_pieces(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """A byte stream in pieces of about _TEXT_PIECE bytes, cut just after a newline."""
    buf = bytearray()
    for block in blocks:
        buf += block
        while len(buf) >= _TEXT_PIECE:
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                if len(buf) < _TEXT_PIECE * _LONG_LINE_FACTOR:
                    break  # wait for a newline a little longer
                cut = _TEXT_PIECE
                while cut > 0 and (buf[cut] & 0xC0) == 0x80:  # not inside a UTF-8 sequence
                    cut -= 1
                cut = cut or _TEXT_PIECE
            yield bytes(buf[:cut])
            del buf[:cut]
    if buf:
        yield bytes(buf)


def _plain_texts(segment: Segment, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    # One document per file: only the piece that ends the file ends the document.
    previous: str | None = None
    for piece in _text_pieces(decoded_blocks(segment, stats)):
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = piece.decode("utf-8", errors="replace")
            stats.replaced_undecodable += 1
        if previous is not None:
            stats.records += 1
            yield previous, False
        previous = text
    if not previous:
        stats.skipped_empty += 1
        return
    stats.records += 1
    yield previous, segment.file_end


# -- JSONL --------------------------------------------------------------------------------------


def record_lines(blocks: Iterable[bytes], max_bytes: int, stats: RecordStats) -> Iterator[bytes]:
    """The lines of a byte stream (without newlines). A line over `max_bytes` is counted and
    dropped as it streams past, never held whole."""
    pending = bytearray()
    skipping = False  # inside an oversized line: drop bytes up to its newline
    for block in blocks:
        *complete, tail = block.split(b"\n")
        for part in complete:
            if skipping:
                skipping = False
                continue
            if pending:
                part = bytes(pending) + part
                pending.clear()
            if len(part) > max_bytes:
                stats.skipped_oversized += 1
                continue
            yield part
        if skipping:
            continue
        if len(pending) + len(tail) > max_bytes:
            pending.clear()
            skipping = True
            stats.skipped_oversized += 1
        else:
            pending += tail
    if pending:
        yield bytes(pending)


def jsonl_objects(lines: Iterable[bytes], stats: RecordStats) -> Iterator[dict]:
    """The JSON objects of JSONL lines; lines that are not UTF-8 or not an object are counted."""
    # Segments are cut just after a newline, so every line here is a whole record.
    for line in lines:
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
        yield obj


def _jsonl_texts(lines: Iterable[bytes], text_field: str, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    for obj in jsonl_objects(lines, stats):
        text = obj.get(text_field)
        if not isinstance(text, str):
            stats.skipped_missing_field += 1
            continue
        if not text:
            stats.skipped_empty += 1
            continue
        stats.records += 1
        yield text, True


# -- parquet ------------------------------------------------------------------------------------

_PARQUET_BATCH_ROWS = 256


def _parquet_texts(
    segment: Segment, text_field: str, max_bytes: int, stats: RecordStats
) -> Iterator[tuple[str, bool]]:
    """The text column of the segment's row groups only; each value is one document."""
    import pyarrow.parquet as pq

    with store.open_read(segment.uri) as f:
        pf = pq.ParquetFile(f)
        groups = list(range(segment.start, min(segment.end, pf.num_row_groups)))
        if text_field not in pf.schema_arrow.names:
            stats.skipped_missing_field += sum(pf.metadata.row_group(i).num_rows for i in groups)
            return
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):
                    if len(value) > max_bytes:
                        stats.skipped_oversized += 1
                        continue
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        stats.skipped_undecodable += 1
                        continue
                if not isinstance(value, str):
                    stats.skipped_missing_field += 1
                    continue
                # UTF-8 takes 1 to 4 bytes a character: encode only when the length is in doubt.
                if len(value) > max_bytes or (
                    len(value) * 4 > max_bytes and len(value.encode("utf-8", "surrogatepass")) > max_bytes
                ):
                    stats.skipped_oversized += 1
                    continue
                if not value:
                    stats.skipped_empty += 1
                    continue
                stats.records += 1
                yield value, True
