import os

import numpy as np
import pytest

from diloco.data.shard import MAGIC, ShardCorrupt, decode_shard, encode_shard, read_shard, write_shard


def sample_rows(n=50, width=9, vocab=257, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, width)).astype(np.uint16)


def test_round_trip_and_header(tmp_path):
    rows = sample_rows()
    uri = str(tmp_path / "shards" / "s0.dlc")
    info = write_shard(uri, rows, tokenizer_id="byte-v1", vocab_size=257, chunk_index=3, meta={"src": "t"})
    assert (info.rows, info.tokens, info.nbytes) == (50, 450, os.path.getsize(uri))
    shard = read_shard(uri, expected_checksum=info.checksum)
    assert np.array_equal(shard.rows, rows) and shard.rows.dtype == np.uint16
    assert shard.rows.flags.writeable
    h = shard.header
    assert (h["format_version"], h["seq_len"], h["rows"], h["tokens"], h["dtype"]) == (
        2,
        8,
        50,
        450,
        "uint16",
    )
    assert (h["tokenizer_id"], h["chunk_index"], h["meta"]) == ("byte-v1", 3, {"src": "t"})
    assert h["checksum"] == info.checksum and info.checksum.startswith("sha256:")
    assert sorted(os.listdir(tmp_path / "shards")) == ["s0.dlc"]  # atomic: no tmp file left


def test_uint32_for_large_vocab_and_empty_shard():
    rows = np.array([[0, 70_000, 99_999]], dtype=np.int64)
    data, header = encode_shard(rows, tokenizer_id="hf-x", vocab_size=100_000, chunk_index=0)
    assert header["dtype"] == "uint32"
    assert decode_shard(data).rows.tolist() == rows.tolist()
    empty, _ = encode_shard(np.zeros((0, 5), np.uint16), tokenizer_id="b", vocab_size=257, chunk_index=1)
    assert decode_shard(empty).rows.shape == (0, 5)


def test_encode_refuses_bad_rows():
    with pytest.raises(ValueError, match="token ids"):
        encode_shard(np.array([[1, 300]]), tokenizer_id="b", vocab_size=257, chunk_index=0)
    with pytest.raises(ValueError, match="shape"):
        encode_shard(np.arange(4), tokenizer_id="b", vocab_size=257, chunk_index=0)


@pytest.fixture
def shard_bytes():
    data, _ = encode_shard(sample_rows(), tokenizer_id="byte-v1", vocab_size=257, chunk_index=0)
    return data


def test_flipped_payload_byte(shard_bytes):
    for pos in (len(shard_bytes) - 5, len(shard_bytes) - len(shard_bytes) // 3):
        bad = bytearray(shard_bytes)
        bad[pos] ^= 0x40
        with pytest.raises(ShardCorrupt):
            decode_shard(bytes(bad))


def test_truncated(shard_bytes):
    for cut in (0, 5, 11, 40, len(shard_bytes) - 1):
        with pytest.raises(ShardCorrupt, match="truncated"):
            decode_shard(shard_bytes[:cut])


def test_wrong_magic(shard_bytes):
    with pytest.raises(ShardCorrupt, match="magic"):
        decode_shard(b"NOTSHARD" + shard_bytes[len(MAGIC) :])


def test_expected_checksum_mismatch(shard_bytes, tmp_path):
    with pytest.raises(ShardCorrupt, match="expected"):
        decode_shard(shard_bytes, expected_checksum="sha256:" + "0" * 64)
    path = tmp_path / "s.dlc"
    path.write_bytes(shard_bytes)
    with pytest.raises(ShardCorrupt, match=str(path)):
        read_shard(str(path), expected_checksum="sha256:" + "0" * 64)


def test_header_lies_about_size(shard_bytes):
    import json
    import struct

    (n,) = struct.unpack_from("<I", shard_bytes, 8)
    header = json.loads(shard_bytes[12 : 12 + n])
    header["rows"] += 1
    header["tokens"] += 9
    head = json.dumps(header).encode()
    forged = MAGIC + struct.pack("<I", len(head)) + head + shard_bytes[12 + n :]
    with pytest.raises(ShardCorrupt, match="decompresses to"):
        decode_shard(forged)


def _with_header(data: bytes, **changes) -> bytes:
    import json
    import struct

    (n,) = struct.unpack_from("<I", data, 8)
    header = {**json.loads(data[12 : 12 + n]), **changes}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + data[12 + n :]


def test_format_1_shards_are_still_read_and_checked():
    import hashlib
    import struct

    import zstandard as zstd

    rows = sample_rows()
    payload = rows.astype("<u2").tobytes()
    body = zstd.ZstdCompressor(level=3, write_content_size=True).compress(payload)
    v2, _ = encode_shard(rows, tokenizer_id="byte-v1", vocab_size=257, chunk_index=0)
    checksum = "sha256:" + hashlib.sha256(payload).hexdigest()  # format 1: of the uncompressed rows
    (n,) = struct.unpack_from("<I", v2, 8)
    v1 = _with_header(v2[: 12 + n], format_version=1, checksum=checksum, compressed_bytes=len(body)) + body
    assert np.array_equal(decode_shard(v1, expected_checksum=checksum).rows, rows)
    bad = bytearray(v1)
    bad[-4] ^= 0x10
    with pytest.raises(ShardCorrupt):
        decode_shard(bytes(bad))
    with pytest.raises(ShardCorrupt, match="format_version"):
        decode_shard(_with_header(v2, format_version=4))


def test_a_frame_damaged_before_it_was_hashed_fails_zstds_own_checksum(shard_bytes):
    import hashlib
    import struct

    (n,) = struct.unpack_from("<I", shard_bytes, 8)
    body = bytearray(shard_bytes[12 + n :])
    body[len(body) // 2] ^= 0x01  # the sha256 was taken of these bytes: only the frame's checksum knows
    forged = _with_header(shard_bytes[: 12 + n], checksum="sha256:" + hashlib.sha256(body).hexdigest())
    with pytest.raises(ShardCorrupt):
        decode_shard(forged + bytes(body))
