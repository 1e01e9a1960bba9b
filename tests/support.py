"""Helpers the tests share that are not fixtures (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import typer

from cli.main import app
from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger, MergeRecord, ledger_path
from diloco.coordinator.server import start_coordinator as start_coordinator_here
from diloco.corpus import stdlib_files
from diloco.data.worker import DataWorker
from diloco.local.procs import Child, ProcessGroup
from diloco.local.tls import run_certificates
from diloco.model import build_model
from diloco.security.certs import TlsFiles
from diloco.security.transport import (
    CRL_ENV,
    ENV,
    INSECURE_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TOKEN_GRACE_ENV,
    Security,
)
from diloco.v1 import coordinator_pb2 as pb

try:  # typer >= 0.2x ships its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import UsageError

REPO = Path(__file__).resolve().parent.parent


def parse_diloco(args: list[str]) -> typer.Context:
    """Parse argv as `diloco ARGS` the way the CLI would, without running anything: the command's
    context, its options in `.params`. Raises UsageError (unknown command or option, a missing
    value or required option, a value of the wrong type). The compose demo's and the Kubernetes and
    Slurm manifests' commands are checked with it (tests/e2e/test_compose.py, tests/unit/test_deploy.py)."""
    group = typer.main.get_command(app)
    name, *rest = (str(a) for a in args)
    command = group.get_command(group.context_class(group), name)
    if command is None:
        raise UsageError(f"no such command: {name}")
    return command.make_context(name, rest, resilient_parsing=False)


class FakeClock:
    """A clock the test moves: decisions read it, nothing sleeps."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def commit_merge(
    ledger: Ledger,
    fragment: int,
    version: int,
    push_ids: Sequence[str],
    tokens: int,
    steps: int,
    mean_loss: float | None,
    reason: str,
) -> None:
    """One merge of `fragment`, committed on its own (the publisher commits them in groups)."""
    ledger.commit_merges(fragment, [MergeRecord(version, tuple(push_ids), tokens, steps, mean_loss, reason)])


def shard_row(ledger: Ledger, shard_id: int) -> sqlite3.Row | None:
    rows = ledger._q("SELECT * FROM shards WHERE id = ?", (shard_id,))
    return rows[0] if rows else None


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


# The end of a test's `diloco run`: its final evaluation on a few batches and no sample. The
# defaults (64 batches, a 200-token sample) took ~10 s of a core after each run, ~15% of the whole
# suite's time; the main pipeline test keeps the sample and checks these two keys take effect.
QUICK_END = ["--set", "eval.final_batches=4", "--set", "eval.sample_tokens=0"]


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


@contextlib.contextmanager
def tiny_coordinator(
    corpus: Path,
    workdir: Path,
    overrides: dict[str, object],
    security: dict[str, Security] | None = None,
    host: str = "127.0.0.1",
):
    """A real coordinator on a 1-layer GPT with its shards made, and a joined learner client that
    gave the initial parameters: (running, learner, init). `security`: the Security of the
    "coordinator", its "data" worker and the "learner" (mutual TLS); none, plaintext. `host`: where
    it listens ("localhost": on 127.0.0.1 and ::1, two hosts to tell callers apart by)."""
    security = security or {}
    cfg = RunConfig().with_overrides({
        "data.dataset": str(corpus), "data.chunk_bytes": 65536, "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32,
        "model.kwargs.n_head": 2, "sync.fragments": 1, "sync.quorum": 1, "sync.grace_factor": 0.0,
        # A row a step: the tests' pushes name the rows their H steps claim (ledger.push_claim).
        "train.batch_size": 1, **overrides,
    })  # fmt: skip
    running = start_coordinator_here(
        cfg, str(workdir), host, security=security.get("coordinator", Security())
    )
    address = f"127.0.0.1:{running.port}"
    assert DataWorker(address, security=security.get("data", Security())).run() == 0
    learner = CoordinatorClient(address, pb.ROLE_COMPUTE, security=security.get("learner", Security()))
    model_cfg = RunConfig.from_json(learner.join().config_json).model
    init = {
        n: p.detach().clone() for n, p in build_model(model_cfg, model_cfg.vocab_size, 0).named_parameters()
    }
    assert learner.init_parameters(init).accepted
    try:
        yield running, learner, init
    finally:
        learner.close()
        running.stop()


# A plain outer step (lr 1, no momentum, no warm-up): a merge moves the model by its outer
# gradient; epochs enough for the pushes a test makes.
PLAIN_OUTER_STEP = {
    "sync.outer_lr": 1.0,
    "sync.outer_momentum": 0.0,
    "sync.outer_warmup_rounds": 0,
    "data.epochs": 4,
}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """How far a merge moved the parameters (the L2 norm over every tensor)."""
    return sum(float((after[n] - before[n]).norm() ** 2) for n in before) ** 0.5


def uniform_delta(init: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """A delta of 1e-3 in every entry, and how far one whole plain outer step on it moves the model."""
    delta = {n: torch.full_like(t, 1e-3) for n, t in init.items()}
    return delta, moved({n: torch.zeros_like(t) for n, t in delta.items()}, delta)


def push_and_merge(
    learner: CoordinatorClient, fragment: Any, header: pb.TensorHeader, delta: dict[str, torch.Tensor]
) -> float:
    """Push `delta` (quorum 1: its round closes on it) and wait for the merge: how far it moved
    `fragment` (a coordinator's FragmentState)."""
    before, version = {n: t.clone() for n, t in fragment.params.items()}, fragment.version
    assert learner.push(header, delta).accepted
    deadline = time.monotonic() + 20
    while fragment.version == version:
        assert time.monotonic() < deadline, "the merge did not come"
        time.sleep(0.02)
    return moved(before, fragment.params)


def delta_header(learner: CoordinatorClient, codec: str, push_id: str) -> pb.TensorHeader:
    """A push of H steps (a whole round's work, so its merge is a whole outer step) naming the rows
    that back them (ledger.push_claim: a push is credited P × its rows' steps at most) in a shard
    of its own: at train.batch_size 1 (tiny_coordinator's), H rows over P."""
    cfg = learner.config or RunConfig()
    shard = learner.lease_shard()
    steps = cfg.train.inner_steps
    rows = min(shard.rows, -(-steps * cfg.train.batch_size // cfg.sync.fragments))
    header = pb.TensorHeader(
        fragment=0, version=0, inner_steps=steps, tokens=rows * (cfg.model.seq_len + 1), codec=codec,
        push_id=push_id,
    )  # fmt: skip
    header.spans.add(shard_id=shard.shard_id, row_start=0, row_end=rows)
    return header


def stalled_push(
    learner: CoordinatorClient, init: dict[str, torch.Tensor], release: threading.Event
) -> Callable[[], Iterator[pb.TensorStreamMessage]]:
    """Streams of a push that sends its header, declaring a whole fragment's tensors, and then
    nothing until `release` is set: each holds a push slot (and its caller's count) meanwhile."""
    header = delta_header(learner, "fp32", "stalls")
    header.worker_id = learner.worker_id
    for name, t in init.items():
        header.tensors.add(name=name, dtype="float32", shape=list(t.shape))

    def messages() -> Iterator[pb.TensorStreamMessage]:
        yield pb.TensorStreamMessage(header=header)
        release.wait(30)

    return messages


@contextlib.contextmanager
def mtls_job(corpus: Path, workdir: Path):
    """A `diloco run`-like workdir: its CA and certificates in tls/ (the coordinator's, and an
    observer's named "status", as `status --workdir` makes it) and its coordinator serving mutual
    TLS (its coordinator.json written): (running, address, certificates by name). Stopped after."""
    certs = run_certificates(workdir, {"coordinator": "coordinator", "status": "observer"})
    cfg = RunConfig().with_overrides({"data.dataset": str(corpus), "data.chunk_bytes": 65536})
    running = start_coordinator_here(cfg, str(workdir), security=Security(tls=certs["coordinator"]))
    try:
        yield running, f"127.0.0.1:{running.port}", certs
    finally:
        running.stop()


def tls_flags(files: TlsFiles) -> list[str]:
    """The command-line flags that give a role these certificate files."""
    return ["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca]


# Where the identity flags land (cli.common.with_security): a command run in this process leaves
# them in its environment for the next.
SECURITY_ENV = (*ENV.values(), TOKEN_ENV, TOKEN_FILE_ENV, INSECURE_ENV, CRL_ENV, TOKEN_GRACE_ENV)


def cli(*args: str) -> tuple[int, str]:
    """`diloco ARGS` in this process, as a fresh process would run it: no identity flags left in
    the environment by an earlier call. (exit code, output)"""
    from typer.testing import CliRunner

    from cli.main import app

    for variable in SECURITY_ENV:
        os.environ.pop(variable, None)
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def one_error_line(out: str) -> str:
    """The one `error: ` line a refused command prints (and no traceback)."""
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in out, out
    return lines[0]
