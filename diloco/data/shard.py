"""The processed shard file: rows of named columns, zstd-compressed and checksummed.

Layout:
    8 bytes    magic b"DLCSHRD\\x00"
    4 bytes    header length, little-endian u32
    n bytes    header, UTF-8 JSON
    rest       zstd frame of the rows as raw little-endian bytes, C order

The header says everything needed to check the payload before trusting it: dtype, shape,
compressed length and a sha256. Nothing executable is stored.

Format 3 holds named columns of any fixed row shape (a preprocess's arrays, e.g. pixels
float32[1, 8, 8] and label int64[]): the header lists each column's name, dtype and row shape, and
the frame holds the columns one after another, each C-ordered. Its `tokens` counts what the
ledger accounts exactly once: tokens of token columns, else one per row (a sample; `unit` says
which). Packed token rows are still written as format 2, one column `input_ids`.

Format 2 (written now) checksums the zstd frame as stored, and the frame carries zstd's own
checksum of its content, which the decoder verifies as it goes: a reader hashes a fifth of the
bytes it used to, and a shard is refused before it is decompressed when its bytes are not the ones
the data worker wrote. Format 1 (still read) checksummed the uncompressed bytes: with hashing as
slow as decompressing, that held a read to half the speed of zstd alone.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard as zstd

from diloco import store

MAGIC = b"DLCSHRD\x00"
FORMAT_VERSION = 2
COLUMNS_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
UNIT_TOKENS, UNIT_SAMPLES = "tokens", "samples"
# The dtypes a column may hold: numbers and booleans, stored little-endian.
_COLUMN_KINDS = "biuf"
_PREFIX = len(MAGIC) + 4
_MAX_HEADER = 1 << 20  # a real header is a few hundred bytes
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class ShardCorrupt(ValueError):
    """A shard whose bytes do not match what its header promises."""


@dataclass
class ShardInfo:
    uri: str
    rows: int
    tokens: int
    checksum: str
    nbytes: int  # file size


@dataclass
class Shard:
    header: dict[str, Any]
    columns: dict[str, np.ndarray]  # each [rows, *row_shape]

    @property
    def rows(self) -> np.ndarray:
        """The packed token rows [rows, seq_len + 1] of a token shard."""
        return self.columns["input_ids"]

    @property
    def seq_len(self) -> int:
        return int(self.header["seq_len"])

    @property
    def unit(self) -> str:
        return str(self.header.get("unit", UNIT_TOKENS))


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every token id."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def _checksum(payload: Any) -> str:
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def encode_shard(
    rows: np.ndarray,
    *,
    tokenizer_id: str,
    vocab_size: int,
    chunk_index: int,
    meta: dict | None = None,
    level: int = 3,
) -> tuple[bytes, dict]:
    """The file bytes of a shard holding `rows`, and its header."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n, seq_len + 1] with seq_len >= 1, got shape {rows.shape}")
    if rows.dtype.kind not in "iu":
        raise ValueError(f"rows must hold integer token ids, got {rows.dtype}")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{rows.min()}, {rows.max()}]")
    dtype = token_dtype(vocab_size)
    payload = np.ascontiguousarray(rows, dtype=_DTYPES[dtype])
    body = zstd.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(payload)
    header = {
        "format_version": FORMAT_VERSION,
        "tokenizer_id": tokenizer_id,
        "seq_len": int(rows.shape[1] - 1),
        "rows": int(rows.shape[0]),
        "dtype": dtype,
        "tokens": int(rows.size),
        "checksum": _checksum(body),  # of the stored zstd frame (format 2)
        "compressed_bytes": len(body),
        "chunk_index": int(chunk_index),
        "meta": dict(meta or {}),
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return MAGIC + struct.pack("<I", len(head)) + head + body, header


def _parse_header(data: bytes) -> tuple[dict, memoryview]:
    if len(data) < _PREFIX:
        raise ShardCorrupt(f"shard truncated: {len(data)} bytes, shorter than its fixed prefix")
    if data[: len(MAGIC)] != MAGIC:
        raise ShardCorrupt(f"not a diloco shard: magic {bytes(data[: len(MAGIC)])!r}")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    if head_len > _MAX_HEADER or _PREFIX + head_len > len(data):
        raise ShardCorrupt(f"shard truncated or corrupt: header length {head_len}, file {len(data)} bytes")
    try:
        header = json.loads(bytes(data[_PREFIX : _PREFIX + head_len]).decode("utf-8"))
    except ValueError as e:
        raise ShardCorrupt(f"shard header is not UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise ShardCorrupt("shard header is not a JSON object")
    if header.get("format_version") not in _READABLE_VERSIONS:
        raise ShardCorrupt(f"unsupported shard format_version {header.get('format_version')!r}")
    if header["format_version"] == COLUMNS_FORMAT_VERSION:
        return _check_columns_header(header), _body(data, head_len, header)
    for key in ("seq_len", "rows", "tokens", "compressed_bytes", "chunk_index"):
        if not isinstance(header.get(key), int) or isinstance(header.get(key), bool) or header[key] < 0:
            raise ShardCorrupt(f"shard header {key!r} is not a non-negative integer: {header.get(key)!r}")
    for key in ("tokenizer_id", "checksum"):
        if not isinstance(header.get(key), str):
            raise ShardCorrupt(f"shard header {key!r} is missing or not a string")
    if header.get("dtype") not in _DTYPES:
        raise ShardCorrupt(f"shard header dtype {header.get('dtype')!r} is not one of {sorted(_DTYPES)}")
    if header["seq_len"] < 1 or header["tokens"] != header["rows"] * (header["seq_len"] + 1):
        raise ShardCorrupt(
            f"shard header sizes disagree: rows={header['rows']} seq_len={header['seq_len']} "
            f"tokens={header['tokens']}"
        )
    return header, _body(data, head_len, header)


def _body(data: bytes, head_len: int, header: dict) -> memoryview:
    body = memoryview(data)[_PREFIX + head_len :]
    if len(body) != header["compressed_bytes"]:
        raise ShardCorrupt(
            f"shard truncated or padded: payload is {len(body)} bytes, header says {header['compressed_bytes']}"
        )
    return body


def _check_columns_header(header: dict) -> dict:
    for key in ("rows", "tokens", "compressed_bytes", "chunk_index"):
        if not isinstance(header.get(key), int) or isinstance(header.get(key), bool) or header[key] < 0:
            raise ShardCorrupt(f"shard header {key!r} is not a non-negative integer: {header.get(key)!r}")
    if not isinstance(header.get("checksum"), str) or header.get("unit") not in (UNIT_TOKENS, UNIT_SAMPLES):
        raise ShardCorrupt("shard header checksum or unit is missing or wrong")
    columns = header.get("columns")
    if not isinstance(columns, list) or not columns:
        raise ShardCorrupt("shard header has no columns")
    for column in columns:
        try:
            dtype = np.dtype(column["dtype"])
            shape = [int(n) for n in column["shape"]]
            ok = (
                isinstance(column["name"], str) and dtype.kind in _COLUMN_KINDS and all(n >= 0 for n in shape)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ShardCorrupt(f"shard header column {column!r} is not a name, number dtype and row shape")
    return header


def column_schema(columns: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Each column's name, little-endian dtype and row shape: what every shard of a run shares."""
    return [
        {"name": name, "dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape[1:])}
        for name, a in columns.items()
    ]


def encode_columns(
    columns: dict[str, np.ndarray],
    *,
    chunk_index: int,
    tokens_per_row: int = 0,
    meta: dict | None = None,
    level: int = 3,
) -> tuple[bytes, dict]:
    """The file bytes of a format-3 shard of named columns (equal row counts), and its header.
    `tokens_per_row` > 0: rows count as that many tokens; 0: each row is one sample."""
    if not columns:
        raise ValueError("a shard needs at least one column")
    rows = {len(a) for a in columns.values()}
    if len(rows) != 1:
        raise ValueError(f"columns have different row counts: { {n: len(a) for n, a in columns.items()} }")
    for name, a in columns.items():
        if a.dtype.kind not in _COLUMN_KINDS:
            raise ValueError(f"column {name!r} holds {a.dtype}, not numbers")
    (n,) = rows
    schema = column_schema(columns)
    payload = b"".join(
        np.ascontiguousarray(a, dtype=np.dtype(c["dtype"])).tobytes()
        for a, c in zip(columns.values(), schema, strict=True)
    )
    body = zstd.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(payload)
    header = {
        "format_version": COLUMNS_FORMAT_VERSION,
        "columns": schema,
        "rows": n,
        "unit": UNIT_TOKENS if tokens_per_row else UNIT_SAMPLES,
        "tokens": n * (tokens_per_row or 1),
        "checksum": _checksum(body),
        "compressed_bytes": len(body),
        "chunk_index": int(chunk_index),
        "tokenizer_id": "",
        "meta": dict(meta or {}),
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return MAGIC + struct.pack("<I", len(head)) + head + body, header


def _decode_columns(header: dict, body: memoryview) -> Shard:
    actual = _checksum(body)
    if actual != header["checksum"]:
        raise ShardCorrupt(f"shard payload checksum {actual} does not match header {header['checksum']}")
    n, sizes = header["rows"], []
    for c in header["columns"]:
        sizes.append(n * int(np.prod(c["shape"], dtype=np.int64)) * np.dtype(c["dtype"]).itemsize)
    raw = _decompress(body, sum(sizes))
    columns, offset = {}, 0
    for c, size in zip(header["columns"], sizes, strict=True):
        dtype = np.dtype(c["dtype"])
        column = raw[offset : offset + size].view(dtype).reshape(n, *c["shape"])
        columns[c["name"]] = column.astype(dtype.newbyteorder("="), copy=False)
        offset += size
    return Shard(header=header, columns=columns)


def _decompress(body: memoryview, expected: int) -> np.ndarray:
    """Exactly `expected` bytes out of one zstd frame, into a fresh (writable) buffer."""
    try:
        content_size = zstd.frame_content_size(body)
    except zstd.ZstdError as e:
        raise ShardCorrupt(f"shard payload is not a zstd frame: {e}") from e
    if content_size != expected:
        raise ShardCorrupt(f"shard payload decompresses to {content_size} bytes, header implies {expected}")
    out = np.empty(expected, dtype=np.uint8)
    view = memoryview(out)
    got = 0
    try:
        with zstd.ZstdDecompressor().stream_reader(body, read_across_frames=False) as reader:
            while got < expected:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstd.ZstdError as e:
        raise ShardCorrupt(f"shard payload does not decompress: {e}") from e
    if got != expected or extra:
        raise ShardCorrupt(f"shard payload decompressed to {got}+ bytes, header implies {expected}")
    return out


def decode_shard(data: bytes, expected_checksum: str | None = None) -> Shard:
    """Parse and fully verify a shard; any mismatch raises ShardCorrupt."""
    header, body = _parse_header(data)
    if expected_checksum is not None and header["checksum"] != expected_checksum:
        raise ShardCorrupt(f"shard checksum {header['checksum']} is not the expected {expected_checksum}")
    if header["format_version"] == COLUMNS_FORMAT_VERSION:
        return _decode_columns(header, body)
    dtype = _DTYPES[header["dtype"]]
    if header["format_version"] >= 2:  # the stored frame is checked first, then decoded
        actual = _checksum(body)
        if actual != header["checksum"]:
            raise ShardCorrupt(f"shard payload checksum {actual} does not match header {header['checksum']}")
    raw = _decompress(body, header["tokens"] * dtype.itemsize)
    if header["format_version"] == 1:
        actual = _checksum(raw)
        if actual != header["checksum"]:
            raise ShardCorrupt(f"shard payload checksum {actual} does not match header {header['checksum']}")
    rows = raw.view(dtype).reshape(header["rows"], header["seq_len"] + 1)
    return Shard(header=header, columns={"input_ids": rows.astype(dtype.newbyteorder("="), copy=False)})


def completion_problem(data: bytes, rows: int, tokens: int, checksum: str) -> str | None:
    """Why `data` is not the shard a completion describes (its rows, tokens and checksum), or None.

    What the coordinator asks of a shard before it becomes ready: the header agrees with the
    completion, and the stored bytes hash to the header's checksum (format 2 and columns hash the
    zstd frame as stored: no decompression). Format 1 is decoded in full."""
    try:
        header, body = _parse_header(data)
        if header["format_version"] == 1:
            decode_shard(data)
        elif (actual := _checksum(body)) != header["checksum"]:
            return f"its payload hashes to {actual}, its header says {header['checksum']}"
    except ShardCorrupt as e:
        return str(e)
    said = {"rows": rows, "tokens": tokens, "checksum": checksum}
    wrong = [
        f"{k} {header.get(k)!r} in the file, {v!r} in the completion"
        for k, v in said.items()
        if header.get(k) != v
    ]
    return "; ".join(wrong) or None


def write_shard(
    uri: str,
    rows: np.ndarray,
    *,
    tokenizer_id: str,
    vocab_size: int,
    chunk_index: int,
    meta: dict | None = None,
) -> ShardInfo:
    """Encode and write atomically: a reader sees no file or the whole shard."""
    data, header = encode_shard(
        rows, tokenizer_id=tokenizer_id, vocab_size=vocab_size, chunk_index=chunk_index, meta=meta
    )
    store.write_bytes_atomic(uri, data)
    return ShardInfo(
        uri=uri, rows=header["rows"], tokens=header["tokens"], checksum=header["checksum"], nbytes=len(data)
    )


def concat_columns(shards: list[Shard]) -> dict[str, np.ndarray]:
    """The shards' rows as one array per column, in the shards' order."""
    return {name: np.concatenate([s.columns[name] for s in shards]) for name in shards[0].columns}


def read_shard(uri: str, expected_checksum: str | None = None) -> Shard:
    data = store.read_bytes(uri)
    try:
        return decode_shard(data, expected_checksum)
    except ShardCorrupt as e:
        raise ShardCorrupt(f"{uri}: {e}") from e


def write_columns(
    uri: str,
    columns: dict[str, np.ndarray],
    *,
    chunk_index: int,
    tokens_per_row: int = 0,
    meta: dict | None = None,
) -> ShardInfo:
    """Encode a format-3 shard of named columns and write it atomically."""
    data, header = encode_columns(columns, chunk_index=chunk_index, tokens_per_row=tokens_per_row, meta=meta)
    store.write_bytes_atomic(uri, data)
    return ShardInfo(
        uri=uri, rows=header["rows"], tokens=header["tokens"], checksum=header["checksum"], nbytes=len(data)
    )
