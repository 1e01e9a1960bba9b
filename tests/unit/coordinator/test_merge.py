"""The syncer's merge: weights and modes (mean, token, rda), the coverage scale of partial rounds,
the round sum folded one delta at a time, and a stale delta's share."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.merging import (
    MergeAccumulator,
    age_factor,
    coverage_scale,
    merge,
    merge_weight,
    merge_weights,
    outer_step,
)


def formula_merge(deltas, weights, mode):
    """The merge written as its formula, all deltas at once: the oracle the fold is checked against.

    mean/token: Σ w·d. rda: the weighted mean of the norms times the direction of Σ w·d/‖d‖.
    """
    out = {}
    for name in deltas[0]:
        parts = [d[name].to(torch.float32) for d in deltas]
        if mode == "rda":
            norms = [p.norm() for p in parts]
            direction = sum(
                w * (p / n if n > 0 else p) for w, p, n in zip(weights, parts, norms, strict=True)
            )
            mean_norm = sum(w * n for w, n in zip(weights, norms, strict=True))
            dnorm = direction.norm()
            out[name] = direction * (mean_norm / dnorm) if dnorm > 0 else torch.zeros_like(parts[0])
        else:
            out[name] = sum(w * p for w, p in zip(weights, parts, strict=True))
    return out


# -- merge weights and deltas ---------------------------------------------------------------------


def test_merge_weights_mean_is_equal():
    assert merge_weights([100, 5000, 1], [10, 3, 1], "mean") == pytest.approx([1 / 3] * 3)


def test_merge_weights_token_is_tokens_squared_over_steps():
    # raw weights: 100*100/10 = 1000; 200*200/10 = 4000 -> 0.2, 0.8
    assert merge_weights([100, 200], [10, 10], "token") == pytest.approx([0.2, 0.8])
    # 100*100/10 = 1000; 200*200/40 = 1000 -> equal
    assert merge_weights([100, 200], [10, 40], "token") == pytest.approx([0.5, 0.5])
    # 300*300/3 = 30000; 100*100/1 = 10000; 0 -> 0.75, 0.25, 0
    assert merge_weights([300, 100, 0], [3, 1, 5], "rda") == pytest.approx([0.75, 0.25, 0.0])


def test_merge_weights_all_zero_tokens_falls_back_to_equal():
    assert merge_weights([0, 0], [1, 1], "token") == pytest.approx([0.5, 0.5])


def test_merge_weights_unknown_mode_refused():
    with pytest.raises(ValueError, match="unknown merge mode"):
        merge_weights([1], [1], "median")


def test_merge_mean():
    deltas = [
        {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[4.0]])},
        {"a": torch.tensor([3.0, -2.0]), "b": torch.tensor([[0.0]])},
    ]
    out = merge(deltas, merge_weights([1, 1], [1, 1], "mean"), "mean")
    assert torch.equal(out["a"], torch.tensor([2.0, 0.0]))
    assert torch.equal(out["b"], torch.tensor([[2.0]]))


def test_merge_token_weighted():
    deltas = [{"a": torch.tensor([10.0])}, {"a": torch.tensor([0.0])}]
    weights = merge_weights([100, 200], [10, 10], "token")  # 0.2, 0.8
    out = merge(deltas, weights, "token")
    assert out["a"].item() == pytest.approx(2.0)


def test_merge_output_is_float32():
    deltas = [{"a": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}] * 2
    out = merge(deltas, [0.5, 0.5], "mean")
    assert out["a"].dtype == torch.float32


def test_rda_keeps_norm_where_mean_shrinks_it():
    e1 = {"a": torch.tensor([1.0, 0.0, 0.0])}
    e2 = {"a": torch.tensor([0.0, 1.0, 0.0])}
    w = [0.5, 0.5]
    mean = merge([e1, e2], w, "mean")["a"]
    rda = merge([e1, e2], w, "rda")["a"]
    assert mean.norm().item() == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    assert rda.norm().item() == pytest.approx(1.0, abs=1e-6)
    # Same direction as the mean.
    torch.testing.assert_close(rda, torch.tensor([1.0, 1.0, 0.0]) / math.sqrt(2))


def test_rda_norm_is_weighted_mean_of_norms():
    d1 = {"a": torch.tensor([3.0, 0.0])}  # norm 3
    d2 = {"a": torch.tensor([0.0, 1.0])}  # norm 1
    out = merge([d1, d2], [0.25, 0.75], "rda")["a"]
    assert out.norm().item() == pytest.approx(0.25 * 3 + 0.75 * 1, abs=1e-6)


def test_rda_of_identical_deltas_is_the_delta():
    d = {"a": torch.tensor([0.3, -1.2, 2.5]), "b": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    out = merge([d, d, d], [0.2, 0.3, 0.5], "rda")
    for k in d:
        torch.testing.assert_close(out[k], d[k])


def test_rda_of_zero_deltas_is_zero():
    z = {"a": torch.zeros(3)}
    out = merge([z, z], [0.5, 0.5], "rda")
    assert torch.equal(out["a"], torch.zeros(3))
    assert not torch.isnan(out["a"]).any()


def test_merge_refuses_empty():
    with pytest.raises(ValueError):
        merge([], [], "mean")


# -- coverage scale -------------------------------------------------------------------------------


def test_coverage_scale_everyone_contributed_is_one():
    for m in (1, 2, 4, 16):
        assert coverage_scale(m, m) == 1.0


def test_coverage_scale_is_share_of_live_learners():
    assert coverage_scale(1, 4) == 0.25
    assert coverage_scale(3, 4) == 0.75
    assert coverage_scale(2, 8) == 0.25


@pytest.mark.parametrize(("contributors", "live"), [(5, 4), (2, 1), (3, 0), (1, 0), (100, 3)])
def test_coverage_scale_never_above_one(contributors, live):
    # A contributor that died after pushing is not counted live any more: still at most 1.
    assert coverage_scale(contributors, live) == 1.0


@pytest.mark.parametrize("live", [0, 1, 4])
def test_coverage_scale_no_contributors_is_zero(live):
    assert coverage_scale(0, live) == 0.0


def apply_rounds(theta0, rounds, lr):
    """Apply each round (a list of deltas, merged by plain mean) scaled by its coverage; SGD, mu 0."""
    params = {"w": theta0.clone()}
    momentum = {"w": torch.zeros_like(theta0)}
    for deltas, live in rounds:
        merged = merge([{"w": d} for d in deltas], [1 / len(deltas)] * len(deltas), "mean")
        scale = coverage_scale(len(deltas), live)
        grad = {"w": merged["w"] * scale}
        params, momentum = outer_step(params, momentum, grad, lr=lr, mu=0.0, nesterov=True)
    return params["w"]


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_quorum_one_rounds_scaled_by_coverage_equal_one_synchronous_merge(m):
    # K = 1: each of M learners' identical delta d closes a round of its own. Each is scaled by 1/M,
    # so the M rounds together move theta by lr*d, exactly what one synchronous round of all M does.
    # (Values are dyadic, so the arithmetic is exact.)
    theta0 = torch.tensor([1.0, -2.0, 0.5, 0.0])
    d = torch.tensor([0.5, -1.0, 2.0, 0.25])
    lr = 0.5
    async_theta = apply_rounds(theta0, [([d], m)] * m, lr)
    sync_theta = apply_rounds(theta0, [([d] * m, m)], lr)
    assert torch.equal(sync_theta, theta0 - lr * d)
    assert torch.equal(async_theta, sync_theta)


def test_quorum_one_rounds_scaled_by_coverage_non_dyadic():
    theta0 = torch.tensor([0.3, -1.7, 2.2])
    d = torch.tensor([0.1, -0.7, 1.3])
    m, lr = 3, 0.7
    async_theta = apply_rounds(theta0, [([d], m)] * m, lr)
    torch.testing.assert_close(async_theta, theta0 - lr * d, rtol=1e-6, atol=1e-6)
    # Without the scale the M rounds would have moved theta M times as far.
    unscaled = theta0 - m * lr * d
    assert not torch.allclose(async_theta, unscaled)


@pytest.mark.parametrize("mode", ["mean", "token", "rda"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_consuming_merge_and_step_give_the_same_numbers(mode: str, nesterov: bool):
    gen = torch.Generator().manual_seed(3)
    deltas = [{"w": torch.randn(50, generator=gen)} for _ in range(3)]
    params, momentum = {"w": torch.randn(50, generator=gen)}, {"w": torch.randn(50, generator=gen)}
    weights = merge_weights([100, 200, 50], [10, 10, 5], "token")
    pure = formula_merge(deltas, weights, mode)
    kept = {"w": deltas[1]["w"].clone()}
    consumed = merge([{"w": d["w"].clone()} for d in deltas], weights, mode, consume=True)
    torch.testing.assert_close(consumed["w"], pure["w"])
    assert torch.equal(deltas[1]["w"], kept["w"])  # without `consume` nothing is touched
    expected = outer_step(params, momentum, pure, 0.7, 0.9, nesterov, fraction=0.5)
    grad = {"w": pure["w"].clone()}
    got = outer_step(params, momentum, grad, 0.7, 0.9, nesterov, fraction=0.5, consume=True)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a["w"], b["w"])


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["mean", "token", "rda"]),
    counts=st.lists(st.tuples(st.integers(1, 10_000), st.integers(1, 500)), min_size=1, max_size=6),
    scale=st.floats(0.1, 1.0),
    seed=st.integers(0, 2**16),
)
def test_folding_deltas_one_by_one_merges_what_merging_them_all_at_once_does(mode, counts, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    deltas = [{"w": torch.randn(7, 5, generator=gen), "b": torch.randn(3, generator=gen)} for _ in counts]
    if len(deltas) > 1:
        deltas[1]["b"] = torch.zeros(3)  # a zero part (rda divides by norms)
    tokens, steps = [t for t, _ in counts], [s for _, s in counts]
    weights = merge_weights(tokens, steps, mode)
    expected = formula_merge(
        [{n: t.clone() for n, t in d.items()} for d in deltas], [w * scale for w in weights], mode
    )
    acc = MergeAccumulator(mode)
    for d, t, s in zip(deltas, tokens, steps, strict=True):
        acc.add(d, merge_weight(t, s, mode), consume=True)  # the deltas' tensors may be reused
    got = acc.result(scale)
    for name, want in expected.items():
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-6), name


def test_a_round_sum_refuses_what_cannot_be_merged():
    acc = MergeAccumulator("token")
    with pytest.raises(ValueError, match="no deltas"):
        acc.result()
    with pytest.raises(ValueError, match="positive"):
        acc.add({"w": torch.ones(2)}, 0.0)
    acc.add({"w": torch.ones(2)}, 1.0)
    with pytest.raises(ValueError, match="same tensors"):
        acc.add({"v": torch.ones(2)}, 1.0)
    with pytest.raises(ValueError, match="same tensors"):
        acc.add({"w": torch.ones(3)}, 1.0)
    assert acc.count == 1 and torch.equal(acc.result()["w"], torch.ones(2)), "a refused delta adds nothing"


def test_a_stale_delta_enters_the_sum_scaled_but_keeps_its_weight_in_the_normaliser():
    fresh, stale = {"w": torch.full((4,), 2.0)}, {"w": torch.full((4,), 4.0)}
    assert age_factor(0.5, 0) == 1.0 and age_factor(0.5, 2) == 0.25
    acc = MergeAccumulator("token")
    acc.add(fresh, 1.0)
    acc.add(stale, 1.0, age=age_factor(0.5, 1))
    # (2 + 0.5·4) / 2: the stale one counts half, and the step shrinks rather than renormalising.
    assert torch.allclose(acc.result()["w"], torch.full((4,), 2.0))
    for mode in ("token", "rda"):  # a round of one stale push steps by σ of its delta
        lone = MergeAccumulator(mode)
        lone.add({"w": torch.tensor([3.0, 4.0])}, 7.0, age=0.5)
        assert torch.allclose(lone.result()["w"], torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="age factor"):
        MergeAccumulator("token").add(fresh, 1.0, age=0.0)
