"""Bad input at the command line: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from diloco.local.procs import ProcessGroup
from tests.support import run_cli, start_coordinator, wait_for


def assert_clear_error(result, *fragments: str) -> None:
    """Exit 2 and stderr is one `error:` line: no traceback, no gRPC log, no INFO lines of ours."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


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
    assert not (tmp_path / "state").exists(), "the ledger was made before the port was tried"


@pytest.mark.timeout(60)
def test_missing_init_weights(tiny_corpus: Path, tmp_path: Path) -> None:
    result = run_cli(
        ["coordinator", "--workdir", str(tmp_path), "--dataset", str(tiny_corpus),
         "--set", f"model.init_from={tmp_path / 'nope.safetensors'}"],
        timeout=50,
    )  # fmt: skip
    assert_clear_error(result, "model.init_from", "nope.safetensors")


@pytest.mark.timeout(90)
def test_port_held_by_another_coordinator(tiny_corpus: Path, tmp_path: Path) -> None:
    # gRPC servers share a port through SO_REUSEPORT unless told not to: the second must refuse.
    group = ProcessGroup(tmp_path / "logs")
    try:
        address = start_coordinator(group, tmp_path / "first", ["--dataset", str(tiny_corpus)])
        port = address.rsplit(":", 1)[1]
        second = tmp_path / "second"
        result = run_cli(
            ["coordinator", "--workdir", str(second), "--dataset", str(tiny_corpus), "--port", port],
            timeout=50,
        )
        assert_clear_error(result, port)
        assert not (second / "state").exists(), "the ledger was made before the port was tried"
    finally:
        group.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["70000", "-1"])
def test_port_out_of_range(tmp_path: Path, port: str) -> None:
    result = run_cli(["coordinator", "--workdir", str(tmp_path), "--port", port], timeout=50)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Invalid value for '--port'" in result.stderr, result.stderr
    assert not (tmp_path / "coordinator.json").exists()


@pytest.mark.timeout(60)
def test_run_with_missing_dataset_starts_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    result = run_cli(
        ["run", "--dataset", str(tmp_path / "nope"), "--workdir", str(workdir), "--no-progress"], timeout=50
    )
    assert_clear_error(result, "nope")
    assert not workdir.exists(), "a workdir was left behind"


@pytest.mark.timeout(60)
def test_bad_device_in_config(tiny_corpus: Path, tmp_path: Path) -> None:
    result = run_cli(
        ["coordinator", "--workdir", str(tmp_path), "--dataset", str(tiny_corpus),
         "--set", "train.device=bogus"],
        timeout=50,
    )  # fmt: skip
    assert_clear_error(result, "train.device", "bogus")


def left_refusing(coordinator_log: Path, device: str) -> bool:
    lines = coordinator_log.read_text(errors="replace").splitlines()
    return any("reason=refused:" in line and device in line for line in lines)


@pytest.mark.timeout(120)
def test_learner_refuses_a_device_it_does_not_have(tiny_corpus: Path, tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        address = start_coordinator(group, tmp_path / "coord", ["--dataset", str(tiny_corpus)])
        log = group.by_role("coordinator")[0].log_path
        # cuda:99: no CUDA at all on a CPU machine, too few devices on a GPU one.
        for device in ("bogus", "cuda:99"):
            result = run_cli(["compute", "--coordinator", address, "--device", device], timeout=60)
            assert result.returncode == 2, result.stderr
            assert "Traceback" not in result.stderr, result.stderr
            errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and device in errors[0], result.stderr
            # It left the run with the reason, as for any other set-up it refuses.
            wait_for(lambda d=device: left_refusing(log, d), 10, f"a refused leave naming {device}")
    finally:
        group.stop()


@pytest.mark.timeout(120)
def test_reused_workdir_with_another_dataset_is_refused(tiny_corpus: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("print('hello')\n" * 200)
    group = ProcessGroup(tmp_path / "logs")
    try:
        start_coordinator(group, workdir, ["--dataset", str(tiny_corpus)])  # partitions tiny_corpus
    finally:
        group.stop()
    for command in (["coordinator"], ["run", "--no-progress", "--minutes", "0.2"]):
        result = run_cli([*command, "--workdir", str(workdir), "--dataset", str(other)], timeout=60)
        assert_clear_error(result, str(tiny_corpus), "--workdir")
    assert not (workdir / "summary.json").exists()
    # The same dataset (spelled with a trailing slash) resumes as before.
    (workdir / "coordinator.json").unlink()
    group = ProcessGroup(tmp_path / "logs2")
    try:
        start_coordinator(group, workdir, ["--dataset", f"{tiny_corpus}/"])
        assert "resuming run" in group.tail(group.by_role("coordinator")[0])
    finally:
        group.stop()
