"""InitParameters under attack, on a real coordinator (redteam report, defects 4, 12, 13, 15): the
first learner cannot mark parameters as running statistics nor offer another model than the run's
(init_check); init streams are capped per caller, watched like pushes (a silent or stalled one is
cut and frees the one init slot) and answered unread once the run has parameters; an init the
fragments cannot split is refused with its reason before anything changes. Deadlines are moved
by the service's stream clock, never slept through."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.stream_watch import StreamLimits, stalled
from diloco.errors import DilocoError
from diloco.fragments import assign_fragments
from diloco.model import build_model
from diloco.model.contract import running_stats, synced_tensors
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import spec_of
from tests.support import start_coordinator_here

TINY_GPT = {"model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32, "model.kwargs.n_head": 2}


@contextlib.contextmanager
def uninitialized(corpus: Path, workdir: Path, overrides: dict[str, object]) -> Iterator:
    """A real coordinator with no parameters yet, and a way to join learners to it:
    (running, learner(name) -> a joined client, the run's own model's tensors)."""
    cfg = RunConfig().with_overrides({
        "data.dataset": str(corpus), "data.chunk_bytes": 65536, "sync.fragments": 1, **TINY_GPT, **overrides,
    })  # fmt: skip
    running = start_coordinator_here(cfg, str(workdir), "127.0.0.1")
    clients: list[CoordinatorClient] = []

    def learner(name: str) -> CoordinatorClient:
        client = CoordinatorClient(
            f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE, retry_deadline_s=5, worker_id=name
        )
        client.join()
        clients.append(client)
        return client

    model_cfg = running.service.config.model
    try:
        model = synced_tensors(build_model(model_cfg, model_cfg.vocab_size, 0))
    except DilocoError:  # a factory this machine cannot build
        model = {}
    try:
        yield running, learner, {n: t.detach().clone() for n, t in model.items()}
    finally:
        for client in clients:
            client.close()
        running.stop()


def refused(call, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value
    details = caught.value.details()
    assert "\n" not in details and "Traceback" not in details, details
    return details


def untouched(running) -> None:
    """A refused init changed nothing: no parameters, specs, statistics, marker or slot."""
    service = running.service
    assert not service.fragments and service.specs == {} and service.averaged == frozenset()
    assert service.ledger.get_meta("param_specs") is None and service._initializing is None


def header_then(tensors: dict[str, torch.Tensor], worker_id: str, release: threading.Event):
    """An init stream that sends its header, then nothing until `release`."""
    header = pb.TensorHeader(worker_id=worker_id)
    header.tensors.extend(spec_of(n, t) for n, t in tensors.items())

    def messages() -> Iterator[pb.TensorStreamMessage]:
        yield pb.TensorStreamMessage(header=header)
        release.wait(30)

    return messages()


def silent(release: threading.Event) -> Iterator[pb.TensorStreamMessage]:
    """An init stream that sends nothing, not even a header, until `release`."""
    release.wait(30)
    yield from ()


def open_inits(running) -> int:
    return running.service.callers._open["init", "host:127.0.0.1"]


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_parameters_marked_as_running_statistics_are_refused_and_change_nothing(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Defect 4: the first learner marked every parameter `averaged`, and from then on no
    parameter had an outlier check or an outer step. The name decides, both ways."""
    with uninitialized(tiny_corpus, tmp_path, {}) as (running, learner, model):
        evil = learner("evil")
        details = refused(lambda: evil.init_parameters(model, averaged=frozenset(model)))
        assert "marked as running statistics are not named as one" in details, details
        untouched(running)
        # The red team's own init: two made-up parameters, both marked.
        made_up = {"a.weight": torch.zeros(1000), "b.weight": torch.zeros(1000)}
        details = refused(lambda: evil.init_parameters(made_up, averaged=frozenset(made_up)))
        assert "['a.weight', 'b.weight']" in details, details
        # A statistic left unmarked would take the outer step on values learners push as values.
        stats = {"w": torch.ones(4), "bn.running_var": torch.ones(4)}
        assert "not marked averaged: ['bn.running_var']" in refused(lambda: evil.init_parameters(stats))
        untouched(running)
        assert running.service.ledger.counter("inits_refused") == 3
        # The run's model, marked as it is: taken, with no parameter averaged.
        assert learner("honest").init_parameters(model).accepted
        assert running.service.averaged == frozenset() and len(running.service.specs) == len(model)


@pytest.mark.timeout(120)
def test_an_init_that_is_not_the_runs_model_is_refused_in_one_line(tiny_corpus: Path, tmp_path: Path) -> None:
    """Defect 4: the coordinator builds the run's model (meta device, once) and refuses an init
    whose names, shapes, dtypes or running statistics differ."""
    with uninitialized(tiny_corpus, tmp_path / "gpt", {}) as (running, learner, model):
        evil = learner("evil")
        name = next(iter(model))
        wider = {**model, name: torch.zeros(model[name].shape[0] + 1, *model[name].shape[1:])}
        details = refused(lambda: evil.init_parameters(wider))
        assert "not the model of model.factory diloco.model.gpt:gpt: shapes differ" in details, details
        fewer = dict(list(model.items())[1:])
        assert f"missing [{name!r}]" in refused(lambda: evil.init_parameters(fewer))
        halved = {**model, name: model[name].half()}
        assert "dtypes differ" in refused(lambda: evil.init_parameters(halved))
        untouched(running)
        assert learner("honest").init_parameters(model).accepted
    # A run that names its factory: a model of BatchNorm's statistics, checked as they are.
    with uninitialized(tiny_corpus, tmp_path / "bn", {"model.factory": "tests.toy_models:batchnorm_mlp"}) as (
        running,
        learner,
        _,
    ):
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )
        tensors = {n: t.detach().clone() for n, t in synced_tensors(model).items()}
        stats = frozenset(running_stats(model))
        evil = learner("evil")
        # Another model entirely (the built-in GPT's exemption is for a coordinator that names none).
        assert "missing ['0.bias'" in refused(lambda: evil.init_parameters({"w": torch.ones(3)}))
        untouched(running)
        assert learner("honest").init_parameters(tensors, averaged=stats).accepted
        assert running.service.averaged == stats == {"1.running_mean", "1.running_var"}


@pytest.mark.timeout(120)
def test_an_init_the_coordinator_cannot_check_is_taken_and_said(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Learners that bring their own model to a coordinator left at the built-in GPT
    (diloco.connect without --model), and a factory not installed on the coordinator's machine:
    the init is taken as before, and the log says it was not checked."""
    own = {"model.embed_tokens.weight": torch.ones(8, 4), "lm_head.weight": torch.ones(8, 4)}
    with caplog.at_level(logging.WARNING, logger="diloco.coordinator"):
        with uninitialized(tiny_corpus, tmp_path / "own", {}) as (running, learner, _):
            assert learner("own-0").init_parameters(own).accepted
        with uninitialized(
            tiny_corpus, tmp_path / "elsewhere", {"model.factory": "not_installed_here:model"}
        ) as (
            running,
            learner,
            _,
        ):
            assert learner("l-0").init_parameters(own).accepted
    said = [r.getMessage() for r in caplog.records if "not checked against the run's model" in r.getMessage()]
    assert len(said) == 2, said
    assert "shares no tensor with the built-in diloco.model.gpt:gpt" in said[0], said
    assert "not_installed_here:model cannot be built here" in said[1], said


@pytest.mark.timeout(120)
def test_an_init_the_fragments_cannot_split_is_refused_before_anything_changes(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Defect 15: UNKNOWN with a traceback, after the specs were installed; now INVALID_ARGUMENT
    with the reason, and the run as it was."""
    with uninitialized(tiny_corpus, tmp_path, {"sync.fragments": 5}) as (running, learner, model):
        evil = learner("evil")
        details = refused(lambda: evil.init_parameters({"w": torch.zeros(10)}))
        assert "cannot split 1 non-embedding tensors into 5 fragments (sync.fragments = 5)" in details
        untouched(running)
        assert running.service.ledger.counter("inits_refused") == 1
        # Split as every learner splits its model, by element counts: with its MLP in bfloat16 (a
        # model of one's own, named apart from the built-in GPT's, which is float32), by bytes the
        # fragments would differ.
        model = {f"own.{n}": t.bfloat16() if ".mlp." in n else t for n, t in model.items()}
        assert learner("honest").init_parameters(model).accepted
        plan = assign_fragments([(n, t.numel()) for n, t in model.items()], 5)
        assert [f.names for f in running.service.fragments] == plan


@pytest.mark.timeout(120)
def test_once_initialized_an_init_stream_is_answered_at_once_unread(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Defect 12: 70 header-less init streams from one learner held every handler thread, and
    Status and heartbeats timed out. Once the run has parameters, each is answered at once."""
    with uninitialized(tiny_corpus, tmp_path, {"coordinator.grpc_workers": 4}) as (running, learner, model):
        l1 = learner("l1")
        assert l1.init_parameters(model).accepted
        release = threading.Event()
        try:
            calls = [
                l1.stub.InitParameters.future(silent(release), timeout=20) for _ in range(12)
            ]  # 3× the pool
            replies = [call.result(timeout=10) for call in calls]
            assert all(not r.accepted and r.reason.startswith("already initialized") for r in replies)
            assert l1.status(timeout_s=5, once=True)  # and the pool is free for every other call
        finally:
            release.set()


@pytest.mark.timeout(120)
def test_before_the_init_a_caller_holds_at_most_its_cap_of_init_streams(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Defect 12: before the run has parameters, one caller's open init streams are capped
    (coordinator.max_pushes_per_caller), so silent ones cannot take every handler thread."""
    with uninitialized(tiny_corpus, tmp_path, {"coordinator.max_pushes_per_caller": 2}) as (
        running,
        learner,
        _,
    ):
        l1 = learner("l1")
        release = threading.Event()
        try:
            held = [l1.stub.InitParameters.future(silent(release), timeout=20) for _ in range(2)]
            wait_until(lambda: open_inits(running) == 2, "two held streams")
            details = refused(
                lambda: l1.stub.InitParameters(silent(release), timeout=5), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            assert "2 init calls open already" in details, details
            assert not any(call.done() for call in held)
        finally:
            release.set()
        untouched(running)


@pytest.mark.timeout(120)
def test_a_silent_init_stream_is_cut_at_its_header_deadline(tiny_corpus: Path, tmp_path: Path) -> None:
    """Defect 12: a stream that never sends its header is cut once the clock passes the header
    deadline (10 s), and counted."""
    with uninitialized(tiny_corpus, tmp_path, {}) as (running, learner, _):
        now = [1000.0]
        running.service.stream_clock = lambda: now[0]
        l1 = learner("l1")
        release = threading.Event()
        try:
            call = l1.stub.InitParameters.future(silent(release), timeout=30)
            wait_until(lambda: any(t.name == "stream-watch" for t in threading.enumerate()), "its watch")
            now[0] += 11.0
            wait_until(call.done, "the silent stream to be cut")
            assert call.exception().code() == grpc.StatusCode.CANCELLED
        finally:
            release.set()
        assert running.service.ledger.counter("inits_refused") == 1
        untouched(running)


@pytest.mark.timeout(120)
def test_a_stalled_init_frees_the_init_slot_for_another_learner(tiny_corpus: Path, tmp_path: Path) -> None:
    """Defect 13: l1 sent an init header and then nothing; 45 s later l2's init was still told
    "being initialized by l1" and no model ever existed. Past push_idle_s of silence the stream is
    cut and l2 initializes the run."""
    with uninitialized(tiny_corpus, tmp_path, {}) as (running, learner, model):
        now = [1000.0]
        running.service.stream_clock = lambda: now[0]
        l1, l2 = learner("l1"), learner("l2")
        release = threading.Event()
        try:
            stalled = l1.stub.InitParameters.future(header_then(model, "l1", release), timeout=60)
            wait_until(lambda: running.service._initializing is not None, "l1's init to take the slot")
            reply = l2.init_parameters(model)
            assert not reply.accepted and "being initialized by l1" in reply.reason, reply
            now[0] += running.service.config.coordinator.push_idle_s + 1
            wait_until(stalled.done, "the stalled init to be cut")
            assert stalled.exception().code() == grpc.StatusCode.CANCELLED
            assert l2.init_parameters(model).accepted
        finally:
            release.set()
        assert running.service.fragments and running.service._initializing is None


def test_the_header_deadline_is_a_rule_of_the_clock() -> None:
    limits = StreamLimits(idle_s=30.0, base_s=60.0, min_bytes_per_s=1e6, header_s=10.0)
    assert stalled(109.0, 100.0, 100.0, 0, limits, header_seen=False) == ""
    assert "no header in 11 s (at most 10 s)" in stalled(111.0, 100.0, 100.0, 0, limits, header_seen=False)
    assert stalled(111.0, 100.0, 100.0, 0, limits, header_seen=True) == ""  # then idle_s between two
