"""The no-held-out-split warning gives advice that fits the data: a smaller data.chunk_bytes only
where the files can be cut; a single .npz (or image, or compressed file) is never cut, so it says
to split the data into files."""

from __future__ import annotations

from diloco.config import RunConfig
from diloco.coordinator.held_out import SplitSizes, held_out_warning, most_chunks
from diloco.data.types import UNIT_ROW_GROUPS, ChunkSpec, Segment


def chunk(*segments: Segment) -> ChunkSpec:
    return ChunkSpec(0, segments, "train")


def test_the_most_chunks_a_dataset_can_make() -> None:
    assert most_chunks([chunk(Segment("/d/x.npz", 0, 5000, True))]) == 1
    images = [Segment(f"/d/{c}/{i}.png", 0, 300, True) for c in "ab" for i in range(3)]
    assert most_chunks([chunk(*images)]) == 6
    assert most_chunks([chunk(Segment("/d/a.jsonl.gz", 0, 10**6, True))]) == 1
    parquet = Segment("/d/t.parquet", 0, 3, True, UNIT_ROW_GROUPS, 900)
    assert most_chunks([chunk(parquet), chunk(parquet)]) == 3  # epoch copies: the same row groups
    assert most_chunks([chunk(Segment("/d/t.csv", 0, 5000, True))]) is None  # cut between rows
    assert most_chunks([]) is None


def test_one_npz_file_is_told_to_split_the_data_not_to_set_chunk_bytes() -> None:
    sizes = SplitSizes(chunks=1, held_out=0, nbytes=120_000, most_chunks=1)
    warning = held_out_warning(sizes, RunConfig())
    assert warning is not None and warning.startswith("no held-out split"), warning
    assert "data.chunk_bytes=" not in warning, warning
    assert "one file that is never cut" in warning and "split the data into several files" in warning


def test_a_few_uncut_files_get_a_chunk_bytes_that_makes_one_chunk_each() -> None:
    sizes = SplitSizes(chunks=1, held_out=0, nbytes=6 * 300, most_chunks=6)
    warning = held_out_warning(sizes, RunConfig())
    assert warning is not None and "at most 6 chunks" in warning and "data.chunk_bytes=300" in warning


def test_a_csv_smaller_than_4_kib_is_not_told_to_set_4096() -> None:
    warning = held_out_warning(SplitSizes(chunks=1, held_out=0, nbytes=3000), RunConfig())
    assert warning is not None and "--set data.chunk_bytes=150)" in warning, warning
