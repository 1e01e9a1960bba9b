"""BatchNorm statistics recomputed for the weights they serve (diloco.model.recalibrate): a wrong
set is replaced by the cumulative mean over the first train rows, a model without running
statistics reads nothing, and export writes the recomputed ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from diloco.model.contract import running_stats
from diloco.model.recalibrate import first_rows, recalibrate


class Classifier(nn.Module):
    """BatchNorm straight on the inputs: its exact statistics are the rows' own mean and variance."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, object]:
        logits = self.head(self.bn(batch["x"]))
        accuracy = (logits.argmax(-1) == batch["y"]).float().mean()
        return {"loss": F.cross_entropy(logits, batch["y"]), "metrics": {"accuracy": accuracy}}


def columns(n: int = 64) -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    x = (g.normal(size=(n, 3)) * [1.0, 10.0, 0.1] + [5.0, -20.0, 0.0]).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 5.0).astype(np.int64)}


def test_a_wrong_set_of_statistics_is_replaced_by_the_rows_own() -> None:
    from diloco.evaluate import evaluate

    model, rows = Classifier(), columns()
    with torch.no_grad():  # the statistics of other weights: off by orders of magnitude
        model.bn.running_mean.fill_(100.0)
        model.bn.running_var.fill_(1e-4)
    spoiled = evaluate(model, rows, 16, "cpu").loss
    model.eval()
    momentum = model.bn.momentum
    assert recalibrate(model, rows=lambda: rows, batch_size=16, batches=4) == 64
    x = torch.from_numpy(rows["x"])
    # Batches of one size: the mean of the batch means is the rows' mean; the variances' mean is
    # the within-batch (unbiased) variance, near the rows'.
    assert torch.allclose(model.bn.running_mean, x.mean(0), atol=1e-4)
    assert torch.allclose(model.bn.running_var, x.var(0), rtol=0.15)
    assert evaluate(model, rows, 16, "cpu").loss < spoiled / 10
    assert model.bn.momentum == momentum and not model.training  # as it was
    assert int(model.bn.num_batches_tracked) == 4


def test_only_the_first_batches_are_read_and_never_a_lone_row() -> None:
    model, rows = Classifier(), columns(40)
    assert recalibrate(model, rows=lambda: rows, batch_size=16, batches=2) == 32
    assert torch.allclose(model.bn.running_mean, torch.from_numpy(rows["x"][:32]).mean(0), atol=1e-4)
    assert recalibrate(model, rows=lambda: columns(40), batch_size=16, batches=8) == 32  # whole batches
    before = {n: t.clone() for n, t in running_stats(model).items()}
    one = {k: v[:1] for k, v in rows.items()}
    assert recalibrate(model, rows=lambda: one, batch_size=16, batches=8) == 0  # BatchNorm1d refuses it
    assert recalibrate(model, rows=lambda: None, batch_size=16, batches=8) == 0  # no train rows yet
    assert recalibrate(model, rows=lambda: rows, batch_size=16, batches=0) == 0  # turned off
    assert all(torch.equal(before[n], t) for n, t in running_stats(model).items())


def test_a_model_without_running_statistics_reads_nothing_and_is_untouched() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.BatchNorm1d(4, track_running_stats=False))
    before = {n: t.clone() for n, t in model.state_dict().items()}

    def never() -> None:
        raise AssertionError("a model without running statistics read train rows")

    assert recalibrate(model, rows=never, batch_size=16, batches=32) == 0
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_the_first_rows_are_read_in_the_order_given_and_no_shard_past_them(tmp_path: Path) -> None:
    from diloco.data.shard import write_columns

    shards = []
    for i in range(3):
        info = write_columns(
            str(tmp_path / f"{i}.shard"), {"x": np.full((10, 1), i, np.float32)}, chunk_index=i
        )
        shards.append({"uri": info.uri, "checksum": info.checksum, "rows": info.rows})
    shards.append({"uri": str(tmp_path / "missing.shard"), "checksum": "x", "rows": 10})  # never read
    got = first_rows(shards, 25)
    assert got is not None and got["x"][:, 0].tolist() == [0] * 10 + [1] * 10 + [2] * 5
    assert first_rows([], 25) is None


def test_the_train_head_is_the_first_shards_in_chunk_order_that_hold_the_rows() -> None:
    from diloco.coordinator.ledger.evals import train_head

    found = [("a", "1", 10), ("b", "2", 10), ("c", "3", 10)]
    assert [s["uri"] for s in train_head(found, 15)] == ["a", "b"]
    assert [s["uri"] for s in train_head(found, 10)] == ["a"]
    assert train_head(found, 0) == []


@pytest.mark.timeout(90)
def test_export_writes_statistics_recomputed_for_the_weights(tiny_corpus: Path, tmp_path: Path) -> None:
    """A run whose published statistics are wrong (as merged ones are under an outer step):
    the exported model holds the statistics of its weights on the run's first train rows."""
    from diloco.client import CoordinatorClient
    from diloco.config import RunConfig
    from diloco.data.worker import DataWorker
    from diloco.export import export_run, recalibrate_from_run
    from diloco.model.contract import synced_tensors
    from diloco.model.factory import build_model
    from diloco.model.weights import load_weights
    from diloco.v1 import coordinator_pb2 as pb
    from tests.support import start_coordinator_here

    cfg = RunConfig().with_overrides({
        "data.dataset": str(tiny_corpus), "data.chunk_bytes": 65536, "sync.fragments": 1,
        "model.factory": "tests.toy_models:batchnorm_tokens", "model.vocab_size": 260,
        "train.batch_size": 8, "eval.recalibrate_batches": 4,
    })  # fmt: skip
    workdir = tmp_path / "run"
    running = start_coordinator_here(cfg, str(workdir), "127.0.0.1")
    try:
        address = f"127.0.0.1:{running.port}"
        assert DataWorker(address).run() == 0
        learner = CoordinatorClient(address, pb.ROLE_COMPUTE)
        learner.join()
        model = build_model(learner.config.model, seed=cfg.train.seed)
        wrong = {n: t.detach().clone() for n, t in synced_tensors(model).items()}
        wrong["bn.running_mean"].fill_(100.0)
        wrong["bn.running_var"].fill_(1e-4)
        assert learner.init_parameters(wrong, averaged=frozenset(running_stats(model))).accepted
        learner.close()
        # What an evaluator (or `diloco eval --coordinator`) recalibrates on: the same first rows.
        split = running.service.status_detail()["recalibration_split"]["shards"]
        assert split and sum(s["rows"] for s in split) >= 32
    finally:
        running.stop()
    written = export_run(workdir, tmp_path / "out", "safetensors")
    exported = load_weights(str(next(p for p in written if p.suffix == ".safetensors")))
    assert exported["bn.running_mean"].abs().max() < 10 and exported["bn.running_var"].min() > 1e-3
    model.load_state_dict({**wrong}, strict=False)
    assert recalibrate_from_run(model, learner.config, workdir) == 32
    live = {n: t.clone() for n, t in running_stats(model).items()}
    model.load_state_dict({**wrong}, strict=False)
    assert recalibrate(model, rows=lambda: first_rows(split, 32), batch_size=8, batches=4) == 32
    assert all(torch.equal(live[n], t) for n, t in running_stats(model).items())
    for name in ("bn.running_mean", "bn.running_var"):
        assert torch.allclose(exported[name], running_stats(model)[name]), name
    assert torch.equal(exported["head.weight"], wrong["head.weight"])  # the weights as published
