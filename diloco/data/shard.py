"""The processed shard file: packed token rows, zstd-compressed and checksummed.

Layout:
    8 bytes    magic b"DLCSHRD\\x00"
    4 bytes    header length, little-endian u32
    n bytes    header, UTF-8 JSON
    rest       zstd frame of the rows as raw little-endian bytes, C order

The header says everything needed to check the payload before trusting it: dtype, shape,
compressed length and a sha256. Nothing executable is stored.

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
_READABLE_VERSIONS = (1, 2)
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
    rows: np.ndarray  # [rows, seq_len + 1]

    @property
    def seq_len(self) -> int:
        return int(self.header["seq_len"])


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
    body = memoryview(data)[_PREFIX + head_len :]
    if len(body) != header["compressed_bytes"]:
        raise ShardCorrupt(
            f"shard truncated or padded: payload is {len(body)} bytes, header says {header['compressed_bytes']}"
        )
    return header, body


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
    return Shard(header=header, rows=rows.astype(dtype.newbyteorder("="), copy=False))


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


def read_shard(uri: str, expected_checksum: str | None = None) -> Shard:
    data = store.read_bytes(uri)
    try:
        return decode_shard(data, expected_checksum)
    except ShardCorrupt as e:
        raise ShardCorrupt(f"{uri}: {e}") from e
