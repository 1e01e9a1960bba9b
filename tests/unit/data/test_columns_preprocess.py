"""The built-in preprocess `columns` on tabular data as users have it (sklearn's breast_cancer
written as a CSV): a missing cell is an error naming where it is, never a silently dropped
column; floats come out float32, what a model's weights are; a user's preprocess that raises is
named; a ragged CSV row is counted as what it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diloco.data.preprocess import MissingValue, PreprocessError, columns, process_samples
from diloco.data.samples import iter_records
from diloco.data.types import ChunkSpec, RecordStats, Segment


def whole_file(path: Path) -> ChunkSpec:
    return ChunkSpec(0, (Segment(str(path), 0, path.stat().st_size, True),), "train")


def test_a_numeric_column_with_a_missing_cell_is_refused_not_dropped() -> None:
    records = [{"mean_perimeter": 2.5, "label": 0}, {"mean_perimeter": "", "label": 1}]
    with pytest.raises(MissingValue, match=r"column 'mean_perimeter' is '' in this record") as e:
        columns(records)
    assert e.value.row == 1
    with pytest.raises(MissingValue, match="'NA'"):
        columns([{"x": 1}, {"x": "NA"}])
    with pytest.raises(MissingValue, match="'x' is nan"):
        columns([{"x": 1.0}, {"x": float("nan")}])
    with pytest.raises(MissingValue, match="no other record of its batch has a value"):
        columns([{"x": ""}, {"x": None}])  # numeric elsewhere, perhaps: not dropped either


def test_a_text_column_is_left_out_and_floats_are_float32_integers_int64() -> None:
    out = columns([
        {"name": "a", "x": 1.5, "n": 3, "v": np.zeros(2)},
        {"name": "b", "x": 2, "n": 4, "v": np.ones(2)},
    ])  # fmt: skip
    assert sorted(out) == ["n", "v", "x"]  # "name" is text in every record
    assert (out["x"].dtype, out["n"].dtype, out["v"].dtype) == (np.float32, np.int64, np.float32)
    assert out["x"].tolist() == [1.5, 2.0]
    images = columns([{"image": np.zeros((2, 2), np.uint8)}])["image"]
    assert images.dtype == np.uint8  # not floats: as they are


def test_a_missing_cell_fails_the_chunk_naming_the_column_value_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "breast_cancer.csv"
    path.write_text("mean_radius,mean_perimeter,label\n17.9,122.8,0\n20.5,,0\n19.6,130.0,1\n")
    with pytest.raises(PreprocessError) as e:
        process_samples(
            whole_file(path), columns, "diloco.data.preprocess:columns", classes=[], max_record_bytes=99
        )
    said = str(e.value)
    assert said.startswith("data.preprocess diloco.data.preprocess:columns: column 'mean_perimeter' is ''"), (
        said
    )
    assert f"({path}, record 2)" in said, said
    cut = len("mean_radius,mean_perimeter,label\n17.9,122.8,0\n")
    part = ChunkSpec(0, (Segment(str(path), cut, path.stat().st_size, True),), "train")
    with pytest.raises(PreprocessError, match=rf"\({path}, record 1 from byte {cut}\)"):
        process_samples(part, columns, "columns", classes=[], max_record_bytes=99)


def test_a_csv_of_floats_makes_float32_columns(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b,label\n" + "".join(f"{i * 0.5},{i}.25,{i % 2}\n" for i in range(10)))
    done = process_samples(whole_file(path), columns, "columns", classes=[], max_record_bytes=99)
    assert {c: a.dtype for c, a in done.columns.items()} == {
        "a": np.float32, "b": np.float32, "label": np.int64,
    }  # fmt: skip


def test_an_exception_in_the_users_preprocess_names_the_preprocess(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,target\n1,0\n")

    def prep(records: list[dict]) -> dict[str, np.ndarray]:
        return {"y": np.array([r["label"] for r in records])}

    with pytest.raises(
        PreprocessError, match=r"^data.preprocess mypkg.tab:prep raised KeyError: 'label'$"
    ) as e:
        process_samples(whole_file(path), prep, "mypkg.tab:prep", classes=[], max_record_bytes=99)
    assert isinstance(e.value.__cause__, KeyError)  # the traceback still reaches the user's line


def test_a_ragged_csv_row_is_counted_as_ragged_not_as_a_missing_field(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n3,4,5\n6\n7,8\n")
    stats = RecordStats()
    seg = Segment(str(path), 0, path.stat().st_size, True)
    records = list(iter_records(seg, stats, classes=[], max_record_bytes=99))
    assert records == [{"a": 1, "b": 2}, {"a": 7, "b": 8}]
    assert (stats.skipped_ragged_row, stats.skipped_missing_field, stats.records) == (2, 0, 2)
    assert stats.as_dict()["skipped_ragged_row"] == 2  # what a completion reports (record_stats)
