import os
import sysconfig

import pytest

from diloco import store
from diloco.corpus import STDLIB, resolve_dataset, stdlib_files

EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def test_stdlib_files_are_sorted_py_without_excluded_dirs():
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert len(files) > 100
    assert files == sorted(files)
    for f in files:
        assert f.endswith(".py")
        dirs = os.path.relpath(f, root).split(os.sep)[:-1]
        assert not EXCLUDED.intersection(dirs), f
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in files)
    assert resolve_dataset(STDLIB) == files


def test_resolve_dataset_keeps_supported_kinds(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ["a.txt", "b.md", "sub/c.py", "sub/d.jsonl", "e.csv", "f.bin", ".hidden.txt"]:
        (tmp_path / name).write_text("x\n")
    names = [os.path.relpath(f, tmp_path) for f in resolve_dataset(str(tmp_path))]
    assert names == ["a.txt", "b.md", "sub/c.py", "sub/d.jsonl"]
    assert resolve_dataset(str(tmp_path / "*.md")) == [str(tmp_path / "b.md")]


def test_resolve_dataset_errors(tmp_path):
    with pytest.raises(store.StoreError, match="not found"):
        resolve_dataset(str(tmp_path / "missing"))
    (tmp_path / "only.csv").write_text("a,b\n")
    with pytest.raises(store.StoreError, match=r"no \.txt/.*files in"):
        resolve_dataset(str(tmp_path))
