"""One inner step: precision, the optimizer, MFU (diloco.compute.inner, model.optim, compute.mfu)."""

from __future__ import annotations

import pytest
import torch

from diloco.compute.inner import inner_step, uses_bf16
from diloco.compute.mfu import mfu, peak_flops
from diloco.config import ConfigError, RunConfig
from diloco.model.factory import build_model
from diloco.model.optim import make_inner_optimizer

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_bf16_autocast_is_the_cuda_default_and_asked_for_elsewhere() -> None:
    assert uses_bf16("auto", CUDA) and not uses_bf16("auto", CPU)
    assert uses_bf16("bf16", CPU) and not uses_bf16("fp32", CUDA)
    with pytest.raises(ConfigError, match="train.precision"):
        RunConfig().with_overrides({"train.precision": "fp8", "model.vocab_size": 64}).validate()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_learns_in_either_precision_and_keeps_fp32_parameters(precision: str) -> None:
    cfg = RunConfig().with_overrides({
        "model.vocab_size": 64, "model.seq_len": 16, "model.kwargs.n_layer": 1, "model.kwargs.n_embd": 32,
        "model.kwargs.n_head": 2, "train.precision": precision, "train.warmup_steps": 0, "train.lr": 1e-2,
    })  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model, seed=0)
    optimizer = make_inner_optimizer(model, cfg.train)
    batch = {"input_ids": torch.randint(0, 64, (4, 17))}
    losses = [inner_step(model, optimizer, batch, step=i, train=cfg.train, device=CPU)[0] for i in range(5)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Fused AdamW on the CPU too: one kernel per update, the same arithmetic as torch's per-tensor loop.
    assert optimizer.defaults.get("fused")
    torch.manual_seed(0)
    twin = build_model(cfg.model, seed=0)
    # The same groups as make_inner_optimizer's, stepped by torch's per-tensor loop.
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in make_inner_optimizer(twin, cfg.train).param_groups]  # fmt: skip
    loop = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), foreach=False)
    assert not loop.defaults["fused"]
    twin_losses = [inner_step(twin, loop, batch, step=i, train=cfg.train, device=CPU)[0] for i in range(5)]
    assert twin_losses == pytest.approx(losses, rel=1e-5)


def test_mfu_is_known_only_where_the_peak_is() -> None:
    assert peak_flops(CPU) == 0.0
    assert mfu(1000.0, 10**6, 0.0) == 0.0
    # 6 FLOPs per parameter and token: 1e4 tokens/s of a 1e9-parameter model on 2 ranks of 100 TFLOP/s.
    assert mfu(1e4, 10**9, 100e12, ranks=2) == pytest.approx(0.3)
