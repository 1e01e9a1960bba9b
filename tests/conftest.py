"""Shared fixtures: a small real corpus, and a way to run the `diloco` CLI as a process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.corpus import stdlib_files

REPO = Path(__file__).resolve().parent.parent


def copy_corpus(out: Path, budget_bytes: int) -> Path:
    """Real Python source (stdlib files) as .txt files, up to about budget_bytes."""
    total = 0
    for i, path in enumerate(stdlib_files()):
        size = os.path.getsize(path)
        if not 2_000 <= size <= 60_000:
            continue
        shutil.copy(path, out / f"{i:04d}_{Path(path).stem}.txt")
        total += size
        if total >= budget_bytes:
            break
    return out


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1.5 MB: enough for a training run whose loss clearly falls."""
    return copy_corpus(tmp_path_factory.mktemp("small_corpus"), 1_500_000)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300 KB: learners run out of data within seconds."""
    return copy_corpus(tmp_path_factory.mktemp("tiny_corpus"), 300_000)


def run_cli(
    args: list[str], timeout: float, cwd: Path | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """`python -m cli ARGS` as a real process, output captured, bounded in time."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )
