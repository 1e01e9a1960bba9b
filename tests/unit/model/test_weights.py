"""A whole model in one safetensors file: written by a run, read by the next (model.init_from)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.config import ModelConfig
from diloco.errors import DilocoError
from diloco.model import build_model
from diloco.model.weights import check_matches, load_weights, save_weights


def params_of(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in build_model(cfg, 257, seed).named_parameters()}


def test_round_trip_is_exact(tmp_path: Path) -> None:
    cfg = ModelConfig(kwargs=dict(n_layer=1, n_embd=32, n_head=2))
    params = params_of(cfg, 1)
    uri = str(tmp_path / "model.safetensors")
    save_weights(uri, params, {"versions": "[3, 4]"})
    loaded = load_weights(uri)
    check_matches(params, loaded, uri)
    assert all(torch.equal(loaded[n], t) for n, t in params.items())


def test_weights_of_another_model_are_refused_by_name(tmp_path: Path) -> None:
    uri = str(tmp_path / "model.safetensors")
    save_weights(uri, params_of(ModelConfig(kwargs=dict(n_layer=1, n_embd=32, n_head=2)), 1))
    wider = params_of(ModelConfig(kwargs=dict(n_layer=1, n_embd=64, n_head=2)), 1)
    with pytest.raises(DilocoError, match="shapes differ: .*wte.weight"):
        check_matches(wider, load_weights(uri), uri)
    deeper = params_of(ModelConfig(kwargs=dict(n_layer=2, n_embd=32, n_head=2)), 1)
    with pytest.raises(DilocoError, match=r"missing \['transformer\.h\.1\."):
        check_matches(deeper, load_weights(uri), uri)


def test_missing_or_foreign_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DilocoError, match="not found"):
        load_weights(str(tmp_path / "nope.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(DilocoError, match="not a safetensors file"):
        load_weights(str(junk))
