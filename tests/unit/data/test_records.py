"""Dataset formats and bad input: compressed text and JSONL, parquet row groups, oversized records,
empty and damaged files. Every case is counted and the chunk goes on; none crashes a worker."""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from diloco import store
from diloco.corpus import file_kind, is_splittable, resolve_dataset
from diloco.data import records
from diloco.data.chunks import UNIT_ROW_GROUPS, ChunkSpec, Segment, partition, partition_dataset
from diloco.data.process import process_chunk
from diloco.data.records import RecordStats, iter_documents
from diloco.tokenizer import ByteTokenizer


def texts_of(path: Path, **kwargs) -> tuple[list[str], RecordStats]:
    """Every text of one file, read as the one chunk partition makes of it."""
    chunks = partition([str(path)], chunk_bytes=1 << 30, eval_fraction=0.0)
    stats = RecordStats()
    out = [t for c in chunks for s in c.segments for t, _ in iter_documents(s, "text", stats, **kwargs)]
    return out, stats


def jsonl_bytes(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return b"".join(
        json.dumps({"text": f"doc {i} " + "".join(rng.choice("abcdefgh ") for _ in range(60))}).encode()
        + b"\n"
        for i in range(n)
    )


def compress(data: bytes, codec: str) -> bytes:
    return gzip.compress(data) if codec == "gz" else zstandard.ZstdCompressor().compress(data)


# -- compressed ---------------------------------------------------------------------------------


def test_compressed_kinds_are_recognised_and_never_cut():
    assert [
        file_kind(f"a.{s}")
        for s in (
            "txt.gz",
            "md.zst",
            "jsonl.gz",
            "jsonl.zst",
            "parquet",
            "csv.gz",
            "png.gz",
            "npy",
            "JPG",
            "doc",
        )
    ] == ["text", "text", "jsonl", "jsonl", "parquet", "csv", None, "npy", "image", None]
    assert not is_splittable("a.jsonl.zst") and not is_splittable("a.parquet") and is_splittable("a.jsonl")


@pytest.mark.parametrize("codec", ["gz", "zst"])
def test_compressed_files_read_like_their_plain_twins(tmp_path, codec):
    plain_jsonl = jsonl_bytes(3000)
    plain_text = ("".join(f"line {i} of the text\n" for i in range(20_000)) + "é\n").encode()
    (tmp_path / "a.jsonl").write_bytes(plain_jsonl)
    (tmp_path / f"a.jsonl.{codec}").write_bytes(compress(plain_jsonl, codec))
    (tmp_path / "b.txt").write_bytes(plain_text)
    (tmp_path / f"b.txt.{codec}").write_bytes(compress(plain_text, codec))
    # A compressed file larger than the chunk size is still one segment of its own, whole.
    chunks = partition([str(tmp_path / f"a.jsonl.{codec}")], chunk_bytes=1000, eval_fraction=0.0)
    assert [(s.start, s.end, s.file_end) for c in chunks for s in c.segments] == [
        (0, store.size(str(tmp_path / f"a.jsonl.{codec}")), True)
    ]
    for name in ("a.jsonl", "b.txt"):
        plain, plain_stats = texts_of(tmp_path / name)
        packed, packed_stats = texts_of(tmp_path / f"{name}.{codec}")
        assert "".join(packed) == "".join(plain) and packed_stats == plain_stats
    jsonl_texts, stats = texts_of(tmp_path / f"a.jsonl.{codec}")
    assert len(jsonl_texts) == stats.records == 3000 and stats.truncated_compressed == 0
    # The same tokens as the plain file: one document per record, the text file one document.
    tok = ByteTokenizer()
    for name in ("a.jsonl", "b.txt"):
        a = process_chunk(partition([str(tmp_path / name)], 1 << 30, 0.0)[0], tok, 64, "text")
        b = process_chunk(partition([str(tmp_path / f"{name}.{codec}")], 1 << 30, 0.0)[0], tok, 64, "text")
        assert a.tokens_in == b.tokens_in and sorted(map(bytes, a.rows)) == sorted(map(bytes, b.rows))


class CountingFile(io.RawIOBase):
    """A file that counts the bytes read through it."""

    def __init__(self, inner, counter: list[int]):
        self.inner, self.counter = inner, counter

    def readable(self):
        return True

    def read(self, n=-1):
        data = self.inner.read(n)
        self.counter[0] += len(data)
        return data

    def readinto(self, b):
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, *args):
        return self.inner.seek(*args)

    def tell(self):
        return self.inner.tell()

    def seekable(self):
        return True

    def close(self):
        self.inner.close()
        super().close()


def count_reads(monkeypatch) -> list[int]:
    counter = [0]
    real_open = store.open_read
    monkeypatch.setattr(store, "open_read", lambda uri: CountingFile(real_open(uri), counter))
    return counter


@pytest.mark.parametrize("codec", ["gz", "zst"])
def test_compressed_records_stream_out_before_the_file_is_read(tmp_path, monkeypatch, codec):
    rng = random.Random(1)  # random hex compresses ~2x: the file is a few MB on disk
    data = b"".join(json.dumps({"text": rng.randbytes(400).hex()}).encode() + b"\n" for _ in range(6000))
    path = tmp_path / f"big.jsonl.{codec}"
    path.write_bytes(compress(data, codec))
    counter = count_reads(monkeypatch)
    docs = iter_documents(Segment(str(path), 0, path.stat().st_size, True), "text", RecordStats())
    first, _ = next(docs)
    assert first == json.loads(data.split(b"\n", 1)[0])["text"]
    assert counter[0] < path.stat().st_size // 2, (counter[0], path.stat().st_size)
    docs.close()


@pytest.mark.parametrize("codec", ["gz", "zst"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not_compressed"])
def test_damaged_compressed_file_keeps_what_came_before(tmp_path, codec, damage):
    data = jsonl_bytes(20_000, seed=2)
    blob = compress(data, codec)
    half = len(blob) // 2
    if damage == "truncated":
        blob = blob[:half]
    elif damage == "corrupt":
        blob = blob[:half] + bytes(b ^ 0x5A for b in blob[half : half + 64]) + blob[half + 64 :]
    else:
        blob = b"this file is not compressed at all\n" * 10
    path = tmp_path / f"d.jsonl.{codec}"
    path.write_bytes(blob)
    texts, stats = texts_of(path)  # never raises
    assert stats.truncated_compressed == 1
    if damage == "not_compressed":
        assert texts == []
    else:
        assert 0 < len(texts) < 20_000
        expected = [json.loads(line)["text"] for line in data.splitlines()]
        assert texts == expected[: len(texts)]  # a clean prefix: nothing garbled is kept
    # The whole chunk still becomes rows; the damage is a counter, not a failure.
    out = process_chunk(partition([str(path)], 1 << 30, 0.0)[0], ByteTokenizer(), 16, "text")
    assert out.stats.truncated_compressed == 1 and out.stats.records == len(texts)


# -- oversized records --------------------------------------------------------------------------


def test_oversized_jsonl_records_are_counted_and_skipped(tmp_path):
    big = json.dumps({"text": "x" * 5000}).encode()
    data = b'{"text": "a"}\n' + big + b"\n" + b'{"text": "b"}\n' + big  # the last one has no newline
    for name, blob in [("o.jsonl", data), ("o.jsonl.zst", compress(data, "zst"))]:
        (tmp_path / name).write_bytes(blob)
        texts, stats = texts_of(tmp_path / name, max_record_bytes=1000)
        assert texts == ["a", "b"] and stats.skipped_oversized == 2 and stats.records == 2
        texts, stats = texts_of(tmp_path / name)  # the default (8 MiB) keeps them
        assert len(texts) == 4 and stats.skipped_oversized == 0


def test_line_splitter_drops_a_long_line_across_blocks_without_holding_it():
    stats = RecordStats()
    blocks = [b"ok1\nxxxx", b"xxxxxxxx", b"xxxx\nok2", b"\n\nlast"]
    assert list(records.record_lines(blocks, 6, stats)) == [b"ok1", b"ok2", b"", b"last"]
    assert stats.skipped_oversized == 1


def test_jsonl_line_longer_than_the_chunk_stays_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    lines = [json.dumps({"text": "short"}), json.dumps({"text": "L" * 50_000}), json.dumps({"text": "end"})]
    path.write_text("\n".join(lines) + "\n")
    chunks = partition([str(path)], chunk_bytes=100, eval_fraction=0.0)
    # The first cut target falls inside the long record: it stays whole, in the first chunk.
    assert [(s.start, s.end) for c in chunks for s in c.segments] == [(0, 50_031), (50_031, 50_047)]
    stats = RecordStats()
    texts = [t for c in chunks for s in c.segments for t, _ in iter_documents(s, "text", stats)]
    assert texts == ["short", "L" * 50_000, "end"] and stats.records == 3


def test_plain_text_goes_on_in_pieces_cut_after_newlines(monkeypatch):
    monkeypatch.setattr(records, "_TEXT_PIECE", 10)
    blocks = [b"aaa\nbbb\nccc", b"c\ndd", "é".encode() * 30, b"\nz"]
    pieces = list(records._text_pieces(blocks))
    assert b"".join(pieces) == b"".join(blocks)
    assert pieces[:2] == [b"aaa\nbbb\n", b"cccc\n"]  # cut after the last newline once there are 10 bytes
    assert len(pieces) > 3 and all(p.decode("utf-8") for p in pieces)  # no piece splits a character


# -- parquet ------------------------------------------------------------------------------------


def write_parquet(path: Path, texts: list, row_group_rows: int, **columns) -> None:
    table = pa.table({"text": texts, **columns})
    pq.write_table(table, path, row_group_size=row_group_rows, compression="zstd")


def test_parquet_partitions_by_row_group_from_the_footer_alone(tmp_path, monkeypatch):
    rng = random.Random(3)
    texts = [rng.randbytes(300).hex() for _ in range(4000)]  # ~2.4 MB of text, poorly compressible
    path = tmp_path / "t.parquet"
    write_parquet(path, texts, row_group_rows=250, other=list(range(4000)))  # 16 row groups
    size = path.stat().st_size
    counter = count_reads(monkeypatch)
    chunks = partition([str(path)], chunk_bytes=size // 5, eval_fraction=0.0)
    assert counter[0] <= 100_000, f"partition read {counter[0]} of {size} bytes"  # the footer
    segments = [s for c in chunks for s in c.segments]
    assert all(s.unit == UNIT_ROW_GROUPS for s in segments)
    assert all(a.end == b.start for a, b in zip(segments, segments[1:], strict=False))  # contiguous
    assert segments[0].start == 0 and segments[-1].end == 16 and segments[-1].file_end
    assert 3 <= len(chunks) <= 8 and all(1 <= s.end - s.start <= 4 for s in segments)
    assert sum(c.nbytes for c in chunks) <= size
    # The JSON kept in the ledger and the lease carry the row-group range.
    assert [ChunkSpec.from_json(c.to_json()) for c in chunks] == chunks
    # A worker reads only its own row groups' text column.
    middle = segments[1]
    counter[0] = 0
    stats = RecordStats()
    got = [t for t, end in iter_documents(middle, "text", stats)]
    assert got == texts[middle.start * 250 : middle.end * 250] and stats.records == len(got)
    assert counter[0] < size // 2
    everything = [t for s in segments for t, _ in iter_documents(s, "text", RecordStats())]
    assert everything == texts


def test_parquet_bad_values_are_counted(tmp_path):
    path = tmp_path / "v.parquet"
    write_parquet(path, ["ok", None, "", "y" * 3000, "fine"], row_group_rows=2)
    texts, stats = texts_of(path, max_record_bytes=1000)
    assert texts == ["ok", "fine"]
    assert (stats.skipped_missing_field, stats.skipped_empty, stats.skipped_oversized) == (1, 1, 1)
    # Not a string column, and no such column: every row counted, nothing read.
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": [b"bin", b"\xff\xfe"]}), tmp_path / "bin.parquet")
    assert texts_of(tmp_path / "ints.parquet")[1].skipped_missing_field == 3
    assert texts_of(tmp_path / "other.parquet")[1].skipped_missing_field == 2
    texts, stats = texts_of(tmp_path / "bin.parquet")
    assert texts == ["bin"] and stats.skipped_undecodable == 1


def test_chunk_spec_refuses_a_bad_segment_unit():
    good = ChunkSpec(0, (Segment("/d/x.parquet", 0, 3, True, UNIT_ROW_GROUPS, 1234),), "train")
    assert ChunkSpec.from_json(good.to_json()) == good and good.nbytes == 1234
    bad = good.to_json().replace("row_groups", "pages")
    with pytest.raises(ValueError):
        ChunkSpec.from_json(bad)
    with pytest.raises(ValueError, match="cannot be read"):  # a byte range of a parquet file
        list(iter_documents(Segment("/d/x.parquet", 0, 3, True), "text", RecordStats()))


# -- empty and unreadable files -----------------------------------------------------------------


def test_empty_and_unreadable_files_are_counted_at_partition(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.jsonl.gz").write_bytes(b"")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file at all")
    (tmp_path / "good.txt").write_text("hello\n")
    (tmp_path / "blank.txt.gz").write_bytes(gzip.compress(b""))  # empty once decoded
    files = resolve_dataset(str(tmp_path))
    assert len(files) == 6
    parts = partition_dataset(files, 1 << 20, 0.0)
    assert (parts.stats.empty_files, parts.stats.unreadable_files) == (3, 1)
    assert [s.uri.rsplit("/", 1)[1] for c in parts.chunks for s in c.segments] == ["blank.txt.gz", "good.txt"]
    out = process_chunk(parts.chunks[0], ByteTokenizer(), 2, "text")
    assert out.stats.records == 1 and out.stats.skipped_empty == 1
