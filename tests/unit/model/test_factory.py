"""Model factories, the forward contract, and the model's table of kwargs in the config."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from diloco.config import ConfigError, ModelConfig, RunConfig
from diloco.errors import DilocoError
from diloco.evaluate import evaluate
from diloco.model import GPT, build_model
from diloco.model.contract import (
    ModelContractError,
    group_running_stats_problem,
    layout_difference,
    loss_and_metrics,
    parameter_layout,
    running_stats,
    synced_tensors,
)
from diloco.model.factory import factory_kwargs
from diloco.plugins import resolve
from tests.toy_models import TinyLM, tiny_lm

TOY = "tests.toy_models:tiny_lm"


def test_the_default_factory_is_the_built_in_gpt_built_like_any_other() -> None:
    model = build_model(ModelConfig(seq_len=16, kwargs={"n_layer": 1, "n_embd": 32, "n_head": 2}), 257, 3)
    assert isinstance(model, GPT) and model.seq_len == 16 and len(model.transformer.h) == 1
    # vocab_size and seq_len come from the run, offered by name; kwargs may set them instead
    assert factory_kwargs(resolve(ModelConfig().factory, "k"), ModelConfig(vocab_size=9)) == {
        "vocab_size": 9,
        "seq_len": 128,
    }
    assert factory_kwargs(tiny_lm, ModelConfig(vocab_size=9, kwargs={"vocab_size": 5})) == {"vocab_size": 5}


def test_a_users_factory_builds_the_same_init_for_the_same_seed() -> None:
    cfg = ModelConfig(factory=TOY, vocab_size=257, kwargs={"width": 8})
    a, b, c = (dict(build_model(cfg, seed=s).named_parameters()) for s in (1, 1, 2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert a["hidden.weight"].shape == (8, 8)


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        ("tests.no_such_module:f", {}, r"cannot import tests\.no_such_module here"),
        ("tests.toy_models:missing", {}, "tests.toy_models has no missing"),
        ("tests.toy_models:TOY_CONSTANT", {}, "TOY_CONSTANT is an int, not a function"),
        ("tests.toy_models:not_a_module", {}, "returned a dict, not an nn.Module"),
        (TOY, {"depth": 3}, r"refused model\.kwargs .*depth"),
    ],
)
def test_a_factory_that_cannot_build_the_model_is_named_in_one_line(factory, kwargs, message) -> None:
    with pytest.raises(DilocoError, match=message):
        build_model(ModelConfig(factory=factory, vocab_size=257, kwargs=kwargs))


def test_the_gpts_own_checks_reach_the_user_as_a_refusal() -> None:
    with pytest.raises(DilocoError, match="n_embd .130. must be a multiple of n_head"):
        build_model(ModelConfig(kwargs={"n_embd": 130, "n_head": 4}), 257)


def test_a_forward_may_return_a_loss_an_object_with_loss_or_a_dict() -> None:
    loss = torch.tensor(2.5)
    assert loss_and_metrics(loss, "m")[0].item() == 2.5
    assert loss_and_metrics(SimpleNamespace(loss=loss, logits=None), "m") == (loss, {})
    got, metrics = loss_and_metrics({"loss": loss.reshape(1), "metrics": {"acc": 0.5}}, "m")
    assert got.shape == () and metrics["acc"].item() == 0.5
    with pytest.raises(
        ModelContractError, match=r"m: forward returned a tensor of shape \(2, 4\), not a scalar"
    ):
        loss_and_metrics(torch.zeros(2, 4), "m")
    # A per-sample loss in a dict is named as one, not as "a dict, not a loss".
    with pytest.raises(ModelContractError, match=r"loss has shape \(16,\), not a scalar: reduce it"):
        loss_and_metrics({"loss": torch.zeros(16)}, "m")
    with pytest.raises(ModelContractError, match=r"metric 'accuracy' has shape \(16,\), not a scalar"):
        loss_and_metrics({"loss": loss, "metrics": {"accuracy": torch.ones(16)}}, "m")
    with pytest.raises(ModelContractError, match="metric 'name' is not a number"):
        loss_and_metrics({"loss": loss, "metrics": {"name": "x"}}, "m")
    with pytest.raises(ModelContractError, match="returned a tuple"):
        loss_and_metrics((loss, {}), "m")
    with pytest.raises(ModelContractError, match="metrics must be a dict"):
        loss_and_metrics({"loss": loss, "metrics": [1.0]}, "m")


def test_two_models_differ_by_name_shape_or_dtype_in_one_line() -> None:
    run = parameter_layout(dict(TinyLM(10, 4).named_parameters()))
    assert layout_difference(run, run) == ""
    wider = parameter_layout(dict(TinyLM(10, 8).named_parameters()))
    assert layout_difference(run, wider).startswith("shapes differ: ['embed.weight (10, 8) vs (10, 4)'")
    half = parameter_layout(dict(TinyLM(10, 4).half().named_parameters()))
    assert "dtypes differ: ['embed.weight float16 vs float32'" in layout_difference(run, half)
    fewer = {n: v for n, v in run.items() if n != "out.bias"}
    assert layout_difference(run, fewer) == "missing ['out.bias']"
    assert layout_difference(fewer, run) == "unexpected ['out.bias']"


def test_evaluation_averages_loss_and_metrics_over_rows() -> None:
    model = build_model(ModelConfig(factory=TOY, vocab_size=11, kwargs={"width": 4}), seed=0)
    rows = np.random.default_rng(0).integers(0, 11, size=(7, 9)).astype(np.uint16)
    result = evaluate(model, {"input_ids": rows}, batch_size=3, device="cpu")
    with torch.no_grad():
        whole = model({"input_ids": torch.from_numpy(rows.astype(np.int64))})
    # batches of 3, 3 and 1 rows: weighted by rows, the mean is the whole set's
    assert result.rows == 7 and result.loss == pytest.approx(whole["loss"].item(), rel=1e-5)
    assert result.metrics["accuracy"] == pytest.approx(whole["metrics"]["accuracy"].item(), abs=1e-6)


def test_model_kwargs_are_a_table_in_toml_flags_and_json(tmp_path: Path) -> None:
    cfg = RunConfig().with_overrides(
        {"model.factory": TOY, "model.kwargs.width": "8", "model.kwargs.names": '["a", "b"]'}
    )
    assert cfg.model.kwargs == {"width": 8, "names": ["a", "b"]}  # --set values read as TOML
    assert RunConfig().with_overrides({"model.kwargs.act": "gelu"}).model.kwargs == {"act": "gelu"}
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig.from_toml(path).model == cfg.model
    assert RunConfig.from_json(cfg.to_json()).model == cfg.model
    path.write_text('[model]\nfactory = "x.y:z"\n[model.kwargs]\nrope = { theta = 10000.0 }\nlayers = 2\n')
    assert RunConfig().merged_with_toml(path).model.kwargs == {"rope": {"theta": 10000.0}, "layers": 2}
    with pytest.raises(ConfigError, match="the model's own settings are model.kwargs.n_layer"):
        RunConfig().with_overrides({"model.n_layer": 2})
    with pytest.raises(ConfigError, match="expects a table"):
        RunConfig.from_dict({"model": {"kwargs": 3}})


class LearnedPositions(TinyLM):
    """A user's model with a position embedding for `seq_len` tokens and no `seq_len` attribute
    (the contract does not ask for one): a longer context is an IndexError in its embedding."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__(vocab_size, 8)
        self.embed = torch.nn.Embedding(vocab_size, 8)
        self.positions = torch.nn.Embedding(seq_len, 8)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.positions(torch.arange(idx.size(1)))
        return self.out(torch.tanh(self.hidden(h)))


def test_a_sample_longer_than_the_runs_seq_len_keeps_the_context_within_it() -> None:
    from diloco.evaluate import sample_text
    from diloco.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("byte")
    model = LearnedPositions(tokenizer.vocab_size, seq_len=16)
    with pytest.raises(IndexError):  # what the end of a run met before: the whole context
        sample_text(model, tokenizer, "def ", 40, "cpu", seed=1)
    text = sample_text(model, tokenizer, "def ", 40, "cpu", seed=1, window=16)
    assert text.startswith("def ")


def test_a_spec_imports_from_the_working_directory_in_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m` (the roles) puts the working directory on the import path, the `diloco` console
    script (the run's own process, which builds the model for its final evaluation) does not."""
    (tmp_path / "walk_model_here.py").write_text("def build(**kwargs):\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve("walk_model_here:build", "model.factory")() == 7


def test_running_statistics_travel_beside_the_parameters() -> None:
    """BatchNorm's running mean and variance are synced tensors (merged as a plain mean by the
    coordinator); its step count, and layers without running statistics, are not."""
    kept = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    assert set(running_stats(kept)) == {"1.running_mean", "1.running_var"}
    synced = synced_tensors(kept)
    assert list(synced)[:4] == ["0.weight", "0.bias", "1.weight", "1.bias"]  # parameters first
    assert "1.num_batches_tracked" not in synced and synced["1.running_var"] is kept[1].running_var
    untracked = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, track_running_stats=False), nn.LayerNorm(2))
    assert (
        running_stats(untracked) == {}
        and synced_tensors(untracked).keys() == dict(untracked.named_parameters()).keys()
    )
    cfg = ModelConfig(factory="tests.toy_models:batchnorm_mlp", kwargs={})
    assert running_stats(build_model(cfg, vocab_size=9))  # built as any model is


def test_a_learner_of_several_ranks_refuses_running_statistics() -> None:
    kept = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    problem = group_running_stats_problem(kept, "mypkg:cnn")
    assert problem is not None and "mypkg:cnn: 1 keep running statistics" in problem and "--nproc" in problem
    assert group_running_stats_problem(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2)), "f") is None


def test_a_kwarg_the_factory_does_not_take_is_named_before_any_learner_builds() -> None:
    from diloco.config import ModelConfig
    from diloco.model.factory import kwargs_problem

    said = kwargs_problem(ModelConfig(kwargs={"bogus": 3, "n_layer": 2}))
    assert said is not None and said.startswith("model.kwargs bogus: diloco.model.gpt:gpt takes none")
    assert "n_layer" in said  # what it does take
    assert kwargs_problem(ModelConfig(kwargs={"n_layer": 2})) is None
