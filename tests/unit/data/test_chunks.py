import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco import store
from diloco.data.chunks import ChunkSpec, Segment, partition


def write_lines(path, n_lines, seed=0, max_len=120):
    rng = random.Random(seed)
    data = b"".join(b"x" * rng.randint(0, max_len) + b"\n" for _ in range(n_lines))
    path.write_bytes(data)
    return data


def covered(chunks):
    """{uri: sorted [(start, end)]} over all chunks."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for c in chunks:
        for s in c.segments:
            spans.setdefault(s.uri, []).append((s.start, s.end))
    return {u: sorted(v) for u, v in spans.items()}


def assert_exact_cover(chunks, sizes):
    spans = covered(chunks)
    assert set(spans) == {u for u, n in sizes.items() if n > 0}
    for uri, ranges in spans.items():
        pos = 0
        for start, end in ranges:
            assert start == pos and end > start
            pos = end
        assert pos == sizes[uri]


def test_small_files_grouped(tmp_path):
    files = []
    for i in range(10):
        p = tmp_path / f"f{i}.txt"
        p.write_bytes(b"a" * 100 + b"\n")
        files.append(str(p))
    (tmp_path / "empty.txt").write_bytes(b"")
    files.append(str(tmp_path / "empty.txt"))
    chunks = partition(files, chunk_bytes=350, eval_fraction=0.0)
    assert [len(c.segments) for c in chunks] == [3, 3, 3, 1]
    assert all(s.file_end and s.start == 0 for c in chunks for s in c.segments)
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert all(c.split == "train" for c in chunks)
    assert_exact_cover(chunks, {f: store.size(f) for f in files})


def test_big_file_split_at_newlines_without_full_read(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    data = write_lines(path, 60_000)  # ~3.6 MB
    assert len(data) > 3_000_000
    reads: list[tuple] = []
    real_read = store.read_bytes

    def spy(uri, start=None, end=None):
        reads.append((start, end))
        return real_read(uri, start, end)

    monkeypatch.setattr(store, "read_bytes", spy)
    chunks = partition([str(path)], chunk_bytes=100_000, eval_fraction=0.0)
    assert len(chunks) > 30
    assert all(start is not None for start, _ in reads)
    assert sum(end - start for start, end in reads) < len(data) // 20
    assert_exact_cover(chunks, {str(path): len(data)})
    for c in chunks:
        for s in c.segments:
            assert s.start == 0 or data[s.start - 1 : s.start] == b"\n"
            assert s.file_end == (s.end == len(data))
            if not s.file_end:
                assert data[s.end - 1 : s.end] == b"\n"


def test_record_longer_than_rest_of_file_stays_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"a" * 20 + b"\n" + b"y" * 50_000)  # last record has no newline at all
    chunks = partition([str(path)], chunk_bytes=10, eval_fraction=0.0)
    assert [(s.start, s.end, s.file_end) for c in chunks for s in c.segments] == [
        (0, 21, False),
        (21, 50_021, True),
    ]


def test_deterministic_and_eval_split(tmp_path):
    files = []
    for i in range(40):
        p = tmp_path / f"{i:02d}.md"
        p.write_bytes(b"line\n" * (i + 1))
        files.append(str(p))
    a = partition(files, chunk_bytes=64, eval_fraction=0.1)
    b = partition(files, chunk_bytes=64, eval_fraction=0.1)
    assert a == b
    n_eval = sum(c.split == "eval" for c in a)
    assert n_eval == round(len(a) * 0.1)
    evals = [c.index for c in a if c.split == "eval"]
    assert evals[0] > 0 and evals[-1] < len(a) - 1  # spread, not bunched at an end
    assert all(c.split == "train" for c in partition(files, 64, 0.0))
    two = partition(files[:2], chunk_bytes=10, eval_fraction=0.01)
    assert len(two) == 2 and sum(c.split == "eval" for c in two) == 1
    one = partition(files[:1], chunk_bytes=1000, eval_fraction=0.5)
    assert [c.split for c in one] == ["train"]


def test_chunk_spec_json_round_trip():
    spec = ChunkSpec(
        index=7,
        segments=(Segment("s3://b/x.jsonl", 0, 10, False), Segment("/d/y.txt", 10, 99, True)),
        split="eval",
    )
    assert ChunkSpec.from_json(spec.to_json()) == spec
    assert spec.nbytes == 99
    with pytest.raises(ValueError):
        ChunkSpec.from_json('{"index": 1}')
    with pytest.raises(ValueError):
        ChunkSpec.from_json("not json")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.lists(st.integers(0, 300), max_size=60), min_size=1, max_size=4),
    chunk_bytes=st.integers(1, 2000),
    trailing_newline=st.booleans(),
)
def test_partition_covers_every_byte_once(tmp_path_factory, lines, chunk_bytes, trailing_newline):
    root = tmp_path_factory.mktemp("prop")
    sizes, datas = {}, {}
    for i, lengths in enumerate(lines):
        data = b"".join(b"z" * n + b"\n" for n in lengths)
        if not trailing_newline and data:
            data = data[:-1]
        path = root / f"{i}.txt"
        path.write_bytes(data)
        sizes[str(path)], datas[str(path)] = len(data), data
    chunks = partition(sorted(sizes), chunk_bytes, eval_fraction=0.2)
    assert_exact_cover(chunks, sizes)
    for c in chunks:
        for s in c.segments:
            assert s.start == 0 or datas[s.uri][s.start - 1 : s.start] == b"\n"
