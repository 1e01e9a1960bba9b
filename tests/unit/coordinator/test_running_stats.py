"""Running statistics (BatchNorm's mean and variance) on a real coordinator: said at init, kept
across a restart, merged as the plain mean of what the pushes hold (no momentum), and left out of
the delta norm the outlier check compares (they move with the data, not the learning rate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.data.worker import DataWorker
from diloco.v1 import coordinator_pb2 as pb
from tests.support import delta_header, start_coordinator_here

STATS = "bn.running_var"


@pytest.mark.timeout(90)
def test_running_statistics_are_merged_as_a_plain_mean_and_kept_across_a_restart(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "sync.fragments": 1, "sync.quorum": 1,
        "sync.grace_factor": 0.0, "sync.outer_warmup_rounds": 0,  # lr 0.7, μ 0.9 from the first merge
        "train.batch_size": 1,  # a row a step: the push names the rows of its H steps (delta_header)
    })  # fmt: skip
    running = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    address = f"127.0.0.1:{running.port}"
    try:
        assert DataWorker(address).run() == 0
        learner = CoordinatorClient(address, pb.ROLE_COMPUTE)
        learner.join()
        init = {"w": torch.ones(4), STATS: torch.ones(4)}
        assert learner.init_parameters(init, averaged=frozenset({STATS})).accepted
        specs = json.loads(running.ledger.get_meta("param_specs"))
        assert {s["name"]: s["averaged"] for s in specs} == {"w": False, STATS: True}
        # The learner's variance fell to 0.01: statistics go as their values, the rest as deltas.
        delta = {"w": torch.full((4,), 0.01), STATS: torch.full((4,), 0.01)}
        assert learner.push(delta_header(learner, "fp32", "p-1"), delta).accepted
        assert running.service.wait_published(30)
        frag = running.service.fragments[0]
        assert torch.allclose(frag.params[STATS], torch.full((4,), 0.01))  # the mean, not below zero
        assert torch.count_nonzero(frag.momentum[STATS]) == 0
        assert frag.params["w"][0].item() == pytest.approx(1.0 - 0.7 * 0.01 * 1.9)  # Nesterov's step
        # The outlier check's history holds the parameters' norm alone: ‖0.01 × 4‖ = 0.02.
        assert list(frag.recent_norms) == [pytest.approx(0.02)]
        learner.close()
    finally:
        running.stop()
    again = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        assert again.service.averaged == frozenset({STATS})
    finally:
        again.stop()


@pytest.mark.timeout(90)
def test_a_learner_of_several_ranks_refuses_running_statistics_at_join(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    from diloco.compute.handshake import join_run
    from diloco.model.contract import ModelContractError

    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "model.factory": "tests.toy_models:batchnorm_mlp",
        "sync.outer_lr": 1.0, "sync.outer_momentum": 0.0,
    })  # fmt: skip
    running = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        client = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        with pytest.raises(ModelContractError, match=r"keep running statistics.*--nproc"):
            join_run(
                client, connect_timeout_s=10, device="cpu", threads=1, mark=lambda _: None, place=lambda d: d
            )
        assert not running.service.fragments  # it offered no parameters
    finally:
        running.stop()


@pytest.mark.timeout(90)
def test_a_learner_with_running_statistics_joins_at_the_default_outer_step(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Refused until the global model's statistics were recomputed for its weights wherever it is
    judged (recalibrate): on digits, lr 0.7 and μ 0.9 then held out 93.7% with BatchNorm against
    87.4% without it, so the outer step is the user's choice for both alike."""
    from diloco.compute.handshake import join_run

    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "model.factory": "tests.toy_models:batchnorm_mlp",
    })  # fmt: skip
    assert (cfg.sync.outer_lr, cfg.sync.outer_momentum) == (0.7, 0.9)
    running = start_coordinator_here(cfg, str(tmp_path), "127.0.0.1")
    try:
        client = CoordinatorClient(f"127.0.0.1:{running.port}", pb.ROLE_COMPUTE)
        joined = join_run(client, connect_timeout_s=10, device="cpu", threads=1, mark=lambda _: None)
        assert joined.averaged == {"1.running_mean", "1.running_var"}
        assert running.service.averaged == frozenset(joined.averaged)
        client.close()
    finally:
        running.stop()
