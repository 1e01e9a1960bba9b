"""Bad input at the command line: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import run_cli


def assert_clear_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


@pytest.mark.timeout(60)
def test_missing_dataset(tmp_path: Path) -> None:
    result = run_cli(
        ["coordinator", "--workdir", str(tmp_path), "--dataset", str(tmp_path / "nope")], timeout=50
    )
    assert_clear_error(result, "nope")


@pytest.mark.timeout(60)
def test_unknown_config_key(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[train]\ninner_stepz = 3\n")
    result = run_cli(["coordinator", "--workdir", str(tmp_path), "--config", str(config)], timeout=50)
    assert_clear_error(result, "inner_stepz")
    result = run_cli(["run", "--set", "sync.quorumm=2", "--workdir", str(tmp_path / "r")], timeout=50)
    assert_clear_error(result, "sync.quorumm")


@pytest.mark.timeout(60)
def test_unreachable_coordinator() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for role in ("data", "compute"):
        result = run_cli([role, "--coordinator", f"127.0.0.1:{port}", "--connect-timeout", "1"], timeout=50)
        assert_clear_error(result, f"127.0.0.1:{port}")


@pytest.mark.timeout(60)
def test_port_in_use(tiny_corpus: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run_cli(
            ["coordinator", "--workdir", str(tmp_path), "--dataset", str(tiny_corpus), "--port", str(port)],
            timeout=50,
        )
    assert_clear_error(result, str(port))


@pytest.mark.timeout(60)
def test_missing_init_weights(tiny_corpus: Path, tmp_path: Path) -> None:
    result = run_cli(
        ["coordinator", "--workdir", str(tmp_path), "--dataset", str(tiny_corpus),
         "--set", f"model.init_from={tmp_path / 'nope.safetensors'}"],
        timeout=50,
    )  # fmt: skip
    assert_clear_error(result, "model.init_from", "nope.safetensors")
