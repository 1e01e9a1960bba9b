"""The built-in GPT, its optimizer and schedule, and the evaluation helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from diloco.compute.device import pick_device, set_threads
from diloco.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from diloco.errors import DilocoError
from diloco.evaluate import eval_loss, generate, sample_text, unigram_entropy
from diloco.model import build_model, lr_at, make_inner_optimizer

pytestmark = pytest.mark.timeout(120)

VOCAB = 257
TINY = ModelConfig(seq_len=16, kwargs=dict(n_layer=2, n_head=2, n_embd=32))


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_same_seed_gives_bitwise_identical_parameters() -> None:
    a, b = _params(build_model(TINY, VOCAB, seed=7)), _params(build_model(TINY, VOCAB, seed=7))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_seed_gives_other_parameters() -> None:
    a, b = _params(build_model(TINY, VOCAB, seed=7)), _params(build_model(TINY, VOCAB, seed=8))
    assert not torch.equal(a["transformer.wte.weight"], b["transformer.wte.weight"])
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"], b["transformer.h.0.attn.c_attn.weight"])


def test_build_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(TINY, VOCAB, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_parameter_names_are_stable_unique_and_tied() -> None:
    model = build_model(TINY, VOCAB, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names))
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert "transformer.h.1.mlp.c_proj.weight" in names
    # the head is tied to the token embedding: one tensor, listed once
    assert "lm_head.weight" not in names
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params() == sum(p.numel() for _, p in model.named_parameters())
    # the same names, in the same order, for any seed
    assert names == [n for n, _ in build_model(TINY, VOCAB, seed=99).named_parameters()]


def test_init_follows_nanogpt() -> None:
    cfg = ModelConfig(seq_len=64)  # the factory's defaults: 4 layers, 4 heads, 128 wide
    params = _params(build_model(cfg, VOCAB, seed=0))
    assert params["transformer.h.0.attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["transformer.h.0.mlp.c_proj.weight"].std().item() == pytest.approx(
        0.02 / math.sqrt(2 * 4), rel=0.05
    )
    assert torch.count_nonzero(params["transformer.h.0.attn.c_attn.bias"]) == 0
    assert torch.all(params["transformer.h.0.ln_1.weight"] == 1.0)


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    model = build_model(TINY, VOCAB, seed=0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (4, TINY.seq_len), generator=g)
    rows = torch.randint(0, VOCAB, (4, TINY.seq_len + 1), generator=g)
    loss = model({"input_ids": rows})
    assert loss.shape == () and abs(loss.item() - math.log(VOCAB)) < 0.3
    assert model.logits(idx).shape == (4, TINY.seq_len, VOCAB)
    assert model.logits(idx[:, :5]).shape == (4, 5, VOCAB)
    with pytest.raises(ValueError, match="seq_len"):
        model.logits(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_adamw_overfits_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = build_model(TINY, VOCAB, seed=0)
    train = TrainConfig(lr=3e-3, warmup_steps=5)
    opt = make_inner_optimizer(model, train)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, VOCAB, (4, TINY.seq_len + 1), generator=g)
    first = None
    for step in range(60):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        loss = model({"input_ids": batch})
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.25 * first


def test_optimizer_decays_matrices_only() -> None:
    model = build_model(TINY, VOCAB, seed=0)
    opt = make_inner_optimizer(model, TrainConfig(weight_decay=0.1, beta1=0.8, beta2=0.9))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert any(p is model.transformer.wte.weight for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["betas"] == (0.8, 0.9)


def test_lr_warms_up_linearly_then_stays_constant() -> None:
    train = TrainConfig(lr=1e-3, warmup_steps=10)
    assert lr_at(0, train) == pytest.approx(1e-4)
    assert lr_at(4, train) == pytest.approx(5e-4)
    assert lr_at(9, train) == pytest.approx(1e-3)
    assert lr_at(10, train) == lr_at(10_000, train) == 1e-3
    assert lr_at(0, TrainConfig(lr=2e-3, warmup_steps=0)) == 2e-3


def test_generate_returns_requested_length_beyond_context() -> None:
    model = build_model(TINY, VOCAB, seed=0).eval()
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = generate(model, idx, TINY.seq_len + 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 3 + TINY.seq_len + 5)
    assert torch.equal(out[:, :3], idx)
    assert int(out.max()) < VOCAB
    greedy = generate(model, idx, 4, temperature=0.0)
    assert torch.equal(greedy, generate(model, idx, 4, temperature=0.0))


def test_unigram_entropy_matches_hand_computation() -> None:
    # counts 0:2, 1:1, 2:1 over 4 tokens -> p = 1/2, 1/4, 1/4
    arrays = [np.array([[0, 1]], dtype=np.uint16), np.array([0, 2], dtype=np.uint32)]
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert unigram_entropy(arrays, vocab_size=5) == pytest.approx(expected)
    assert unigram_entropy([np.array([3, 3, 3])], vocab_size=5) == 0.0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        unigram_entropy([np.array([5])], vocab_size=5)


def test_eval_loss_matches_manual_computation() -> None:
    model = build_model(TINY, VOCAB, seed=0)
    model.train()
    rng = np.random.default_rng(0)
    rows = rng.integers(0, VOCAB, size=(7, TINY.seq_len + 1)).astype(np.uint16)
    batch = torch.from_numpy(rows.astype(np.int64))
    with torch.no_grad():
        logits = model.logits(batch[:, :-1])
        manual = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    # batch size 3 leaves a short last batch: the token-weighted mean must still be exact
    assert eval_loss(model, rows, batch_size=3, device="cpu") == pytest.approx(manual, rel=1e-5)
    assert model.training  # mode restored
    with torch.no_grad():
        logits = model.logits(batch[:2, :-1])
        first_two = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:2, 1:].reshape(-1)).item()
    assert eval_loss(model, rows, batch_size=2, device="cpu", max_batches=1) == pytest.approx(
        first_two, rel=1e-5
    )


class _Bytes:
    vocab_size, eot_id = 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_sample_text_is_seeded_and_starts_with_prompt() -> None:
    model = build_model(TINY, VOCAB, seed=0)
    a = sample_text(model, _Bytes(), "def ", 20, "cpu", seed=3)
    b = sample_text(model, _Bytes(), "def ", 20, "cpu", seed=3)
    assert a == b and a.startswith("def ")
    assert model.training
    assert isinstance(sample_text(model, _Bytes(), "", 5, "cpu", seed=0), str)


def test_pick_device() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    # A DilocoError, so the CLI prints one line instead of a traceback.
    if not torch.cuda.is_available():
        with pytest.raises(DilocoError, match="CUDA is not available"):
            pick_device("cuda")
    with pytest.raises(DilocoError, match="unknown device"):
        pick_device("tpu-ish")
    with pytest.raises(DilocoError, match="unknown device"):
        pick_device("meta")  # a torch device, but not one a learner trains on
    before = torch.get_num_threads()
    set_threads(0)
    assert torch.get_num_threads() == before
    set_threads(1)
    assert torch.get_num_threads() == 1
    set_threads(before)


def test_config_refuses_a_device_of_no_known_form() -> None:
    for good in ("auto", "", "cpu", "cuda", "cuda:3", " CUDA:0 "):
        RunConfig().with_overrides({"train.device": good}).validate()
    for bad in ("bogus", "cuda:", "cuda:x", "gpu", "meta"):
        with pytest.raises(ConfigError, match="train.device"):
            RunConfig().with_overrides({"train.device": bad}).validate()
