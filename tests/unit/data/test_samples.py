"""Records for a preprocess from every kind of input, the preprocess contract, and shards of named
columns (format 3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from diloco.data.chunks import partition_dataset
from diloco.data.preprocess import PreprocessError, check_arrays, columns, process_samples
from diloco.data.samples import image_classes, iter_records
from diloco.data.shard import ShardCorrupt, decode_shard, encode_columns, read_shard, write_columns
from diloco.data.types import ChunkSpec, RecordStats, Segment


def records_of(uri: str, classes: list[str] | None = None, **segment) -> list[dict]:
    size = Path(uri).stat().st_size
    seg = Segment(uri, segment.get("start", 0), segment.get("end", size), segment.get("end", size) == size)
    return list(iter_records(seg, RecordStats(), classes=classes or [], max_record_bytes=1 << 20))


def test_csv_rows_are_records_with_numbers_parsed_and_a_cut_segment_keeps_the_header(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("x,y,name\n1,2.5,a\n3,-4e-1,b\n5,6,c\n")
    assert records_of(str(path)) == [
        {"x": 1, "y": 2.5, "name": "a"}, {"x": 3, "y": -0.4, "name": "b"}, {"x": 5, "y": 6, "name": "c"},
    ]  # fmt: skip
    cut = len("x,y,name\n1,2.5,a\n")
    assert records_of(str(path), start=cut) == [
        {"x": 3, "y": -0.4, "name": "b"},
        {"x": 5, "y": 6, "name": "c"},
    ]


def test_arrays_jsonl_and_parquet_give_one_record_per_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32).reshape(3, 2))
    assert [r["array"].tolist() for r in records_of(str(tmp_path / "a.npy"))] == [[0, 1], [2, 3], [4, 5]]
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 3)), y=np.array([7, 8]))
    assert [int(r["y"]) for r in records_of(str(tmp_path / "b.npz"))] == [7, 8]
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"f": [1, 2]}) + "\nnot json\n" + json.dumps({"f": [3, 4]}) + "\n"
    )
    assert records_of(str(tmp_path / "c.jsonl")) == [{"f": [1, 2]}, {"f": [3, 4]}]
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), tmp_path / "d.parquet")
    seg = Segment(str(tmp_path / "d.parquet"), 0, 1, True, "row_groups", 10)
    assert list(iter_records(seg, RecordStats(), classes=[], max_record_bytes=99)) == [
        {"a": 1, "b": "x"}, {"a": 2, "b": "y"},
    ]  # fmt: skip


def test_images_in_class_folders_are_labelled_by_their_folder(tmp_path: Path) -> None:
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        Image.fromarray(np.full((4, 5), 200 if label == "dog" else 10, np.uint8), mode="L").save(
            tmp_path / label / "1.png"
        )
    files = sorted(str(p) for p in tmp_path.rglob("*.png"))
    classes = image_classes(files)
    assert classes == ["cat", "dog"]
    dog = records_of(files[1], classes)[0]
    assert dog["label"] == 1 and dog["class"] == "dog" and dog["image"].shape == (4, 5)
    assert int(dog["image"][0, 0]) == 200


def test_the_preprocess_contract_is_checked_with_one_line() -> None:
    good = check_arrays({"x": [[1.0, 2.0]], "y": np.array([3])}, "p", None)
    assert good["x"].dtype == np.float64 and good["y"].shape == (1,)
    with pytest.raises(PreprocessError, match="p returned list, not a dict of arrays"):
        check_arrays([1, 2], "p", None)
    with pytest.raises(PreprocessError, match="column 'x' is ragged"):
        check_arrays({"x": [[1, 2], [3]]}, "p", None)
    with pytest.raises(PreprocessError, match="'t' is <U1"):
        check_arrays({"t": ["a"]}, "p", None)
    with pytest.raises(PreprocessError, match="different row counts"):
        check_arrays({"x": [1, 2], "y": [1]}, "p", None)
    schema = [{"name": "x", "dtype": "<f4", "shape": [2]}]
    with pytest.raises(PreprocessError, match=r"columns changed between batches: x: <f8\[2\] vs <f4\[2\]"):
        check_arrays({"x": np.zeros((1, 2))}, "p", schema)


def test_a_chunk_of_records_becomes_shuffled_columns_and_a_verified_shard(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(40)))
    (chunk,) = partition_dataset([str(path)], 1 << 20, 0.0).chunks
    done = process_samples(chunk, columns, "columns", classes=[], max_record_bytes=1 << 20)
    assert done.rows == 40 and sorted(done.columns["a"].tolist()) == list(range(40))
    assert done.columns["a"].tolist() != list(range(40))  # shuffled, seeded by the chunk
    assert (done.columns["b"] == 2 * done.columns["a"]).all()  # rows stay whole
    info = write_columns(str(tmp_path / "s.shard"), done.columns, chunk_index=chunk.index)
    assert (info.rows, info.tokens) == (40, 40)  # samples: one per row
    shard = read_shard(info.uri, info.checksum)
    assert shard.unit == "samples" and shard.columns["b"].tolist() == done.columns["b"].tolist()


def test_column_shards_keep_dtypes_and_shapes_and_refuse_damage() -> None:
    cols = {"pixels": np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32), "label": np.arange(5)}
    data, header = encode_columns(cols, chunk_index=2)
    assert header["columns"] == [
        {"name": "pixels", "dtype": "<f4", "shape": [1, 8, 8]}, {"name": "label", "dtype": "<i8", "shape": []},
    ]  # fmt: skip
    shard = decode_shard(data)
    assert (
        np.array_equal(shard.columns["pixels"], cols["pixels"]) and shard.columns["label"].dtype == np.int64
    )
    bad = bytearray(data)
    bad[-3] ^= 1
    with pytest.raises(ShardCorrupt):
        decode_shard(bytes(bad))
    with pytest.raises(ValueError, match="different row counts"):
        encode_columns({"a": np.zeros(2), "b": np.zeros(3)}, chunk_index=0)


def test_a_preprocess_that_fails_fails_its_chunk(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a\n1\n")
    chunk = ChunkSpec(0, (Segment(str(path), 0, path.stat().st_size, True),), "train")

    def broken(records):
        return {"a": [r["a"] for r in records], "b": ["text"] * len(records)}

    with pytest.raises(PreprocessError, match="data.preprocess broken: column 'b'"):
        process_samples(chunk, broken, "broken", classes=[], max_record_bytes=1 << 20)


def test_a_csv_file_is_cut_only_between_records_and_quoted_newlines_stay_in_their_field(
    tmp_path: Path,
) -> None:
    from diloco.data.chunks import file_segments

    path = tmp_path / "t.csv"
    rows = [(i, f'line one\nline "two" of {i}' if i % 3 == 0 else f"plain {i}") for i in range(200)]
    body = "".join(f'{i},"{text.replace(chr(34), chr(34) * 2)}"\n' for i, text in rows)
    path.write_text("id,text\n" + body)
    size = path.stat().st_size
    for chunk_bytes in (7, 64, 100, 1000):
        segments = file_segments(str(path), size, chunk_bytes)
        assert segments[0].start == 0 and segments[-1].end == size and len(segments) > 1
        assert all(a.end == b.start for a, b in zip(segments, segments[1:], strict=False))
        got = []
        for seg in segments:
            got += records_of(str(path), start=seg.start, end=seg.end)
        assert [(r["id"], r["text"]) for r in got] == rows, chunk_bytes


def test_a_big_npy_file_is_cut_between_rows_and_every_row_is_read_once(tmp_path: Path) -> None:
    from diloco.data.chunks import file_segments

    array = np.arange(300 * 3 * 2, dtype=np.float32).reshape(300, 3, 2)
    np.save(tmp_path / "a.npy", array)
    uri = str(tmp_path / "a.npy")
    size = Path(uri).stat().st_size
    segments = file_segments(uri, size, 1000)  # 24-byte rows: 41 rows a segment
    assert len(segments) == 8 and segments[-1].end == size
    got = [r["array"] for seg in segments for r in records_of(uri, start=seg.start, end=seg.end)]
    assert np.array_equal(np.stack(got), array)
    np.save(tmp_path / "f.npy", np.asfortranarray(array))  # not laid out by rows: one segment
    assert len(file_segments(str(tmp_path / "f.npy"), size, 1000)) == 1


def test_a_runs_classes_are_recorded_at_its_start_and_label_every_later_read(tmp_path: Path) -> None:
    """`diloco eval --dataset` on a subset of the class folders once counted labels from the subset
    (dog became 0): the run records its class names at its first start, and every read uses them."""
    from PIL import Image

    from diloco.config import RunConfig
    from diloco.coordinator.run_record import open_ledger
    from diloco.errors import DilocoError
    from diloco.results import dataset_columns

    data = tmp_path / "images"
    for label in ("cat", "dog", "eel"):
        (data / label).mkdir(parents=True)
        Image.fromarray(np.full((4, 4), 9, np.uint8), mode="L").save(data / label / "1.png")
    cfg = RunConfig().with_overrides(
        {
            "data.dataset": str(data),
            "data.preprocess": "diloco.data.preprocess:columns",
            "data.eval_fraction": 0.0,
        }
    )
    ledger, stored = open_ledger(cfg, str(tmp_path / "run"))
    ledger.close()
    assert stored.data.classes == ["cat", "dog", "eel"]
    subset = tmp_path / "dogs"
    (subset / "dog").mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 9, np.uint8), mode="L").save(subset / "dog" / "2.png")
    columns_read, _ = dataset_columns(stored, str(subset))
    assert columns_read["label"].tolist() == [1]  # the run's dog, not the subset's first class
    (tmp_path / "fish" / "shark").mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 9, np.uint8), mode="L").save(tmp_path / "fish" / "shark" / "3.png")
    with pytest.raises(DilocoError, match="class folder 'shark' is not one of the run's classes"):
        dataset_columns(stored, str(tmp_path / "fish"))
