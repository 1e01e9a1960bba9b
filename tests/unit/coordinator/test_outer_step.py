"""The syncer's outer step: Nesterov and plain momentum by hand and against torch's SGD, the warm-up,
and the share of a step a short round's momentum takes."""

import itertools

import pytest
import torch

from diloco.coordinator.merging import MergeAccumulator, outer_hyper, outer_step, work_fraction

# -- outer step -----------------------------------------------------------------------------------


def run_outer(theta0, grads, lr, mu, nesterov):
    params = {"w": torch.tensor(theta0, dtype=torch.float32)}
    momentum = {"w": torch.zeros_like(params["w"])}
    history = []
    for g in grads:
        params, momentum = outer_step(params, momentum, {"w": torch.tensor(g)}, lr, mu, nesterov)
        history.append((params["w"].item(), momentum["w"].item()))
    return history


def test_outer_step_nesterov_hand_computed():
    # lr 0.7, mu 0.9, theta0 = 1.0, m0 = 0; m <- mu*m + g; theta <- theta - lr*(g + mu*m)
    # step 1, g = 0.5:  m = 0.9*0 + 0.5 = 0.5;      theta = 1.0 - 0.7*(0.5 + 0.45)     = 0.335
    # step 2, g = 0.2:  m = 0.9*0.5 + 0.2 = 0.65;   theta = 0.335 - 0.7*(0.2 + 0.585)  = -0.2145
    # step 3, g = -0.1: m = 0.9*0.65 - 0.1 = 0.485; theta = -0.2145 - 0.7*(-0.1 + 0.4365) = -0.45005
    history = run_outer(1.0, [0.5, 0.2, -0.1], lr=0.7, mu=0.9, nesterov=True)
    expected = [(0.335, 0.5), (-0.2145, 0.65), (-0.45005, 0.485)]
    for (theta, m), (want_theta, want_m) in zip(history, expected, strict=True):
        assert theta == pytest.approx(want_theta, abs=1e-6)
        assert m == pytest.approx(want_m, abs=1e-6)


def test_outer_step_plain_momentum_hand_computed():
    # Without Nesterov: theta <- theta - lr*m
    # step 1: m = 0.5;   theta = 1.0 - 0.7*0.5     = 0.65
    # step 2: m = 0.65;  theta = 0.65 - 0.7*0.65   = 0.195
    # step 3: m = 0.485; theta = 0.195 - 0.7*0.485 = -0.1445
    history = run_outer(1.0, [0.5, 0.2, -0.1], lr=0.7, mu=0.9, nesterov=False)
    expected = [(0.65, 0.5), (0.195, 0.65), (-0.1445, 0.485)]
    for (theta, m), (want_theta, want_m) in zip(history, expected, strict=True):
        assert theta == pytest.approx(want_theta, abs=1e-6)
        assert m == pytest.approx(want_m, abs=1e-6)


def test_outer_step_lr_one_no_momentum_is_plain_delta_subtraction():
    # DiLoCo with lr 1 and mu 0 is "average the learners' weights": theta - mean delta.
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    momentum = {k: torch.zeros_like(v) for k, v in params.items()}
    grad = {"a": torch.tensor([0.25, -1.0]), "b": torch.tensor(0.5)}
    new, _ = outer_step(params, momentum, grad, lr=1.0, mu=0.0, nesterov=True)
    assert torch.equal(new["a"], torch.tensor([0.75, 3.0]))
    assert torch.equal(new["b"], torch.tensor(2.5))


def test_the_outer_warmup_starts_as_averaging_and_ends_at_the_configured_step():
    assert outer_hyper(0.7, 0.9, 0, 0) == (0.7, 0.9)  # no warm-up: the step is fixed from the start
    assert outer_hyper(0.7, 0.9, 4, 0) == (1.0, 0.0)  # the first merge averages the learners
    lr, mu = outer_hyper(0.7, 0.9, 4, 2)
    assert lr == pytest.approx(0.85) and mu == pytest.approx(0.45)
    assert outer_hyper(0.7, 0.9, 4, 4) == outer_hyper(0.7, 0.9, 4, 400) == (0.7, 0.9)
    steps = [outer_hyper(0.7, 0.9, 10, v) for v in range(12)]
    assert all(a[1] <= b[1] and a[0] >= b[0] for a, b in itertools.pairwise(steps))  # monotone


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (4, 3), "b": (3,), "s": ()}
    init = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(5)]

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=nesterov)
    params = {k: v.clone() for k, v in init.items()}
    momentum = {k: torch.zeros_like(v) for k, v in init.items()}
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        params, momentum = outer_step(params, momentum, g, lr=0.7, mu=0.9, nesterov=nesterov)
        for k in shapes:
            torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                momentum[k], opt.state[ref[k]]["momentum_buffer"], rtol=1e-6, atol=1e-6
            )


def test_outer_step_returns_new_tensors_and_keeps_dtype():
    params = {"w": torch.tensor([1.0, -1.0], dtype=torch.bfloat16)}
    momentum = {"w": torch.zeros(2)}
    grad = {"w": torch.tensor([0.5, 0.5])}
    new_p, new_m = outer_step(params, momentum, grad, lr=0.7, mu=0.9, nesterov=True)
    assert new_p["w"].dtype == torch.bfloat16
    assert torch.equal(params["w"], torch.tensor([1.0, -1.0], dtype=torch.bfloat16))  # input untouched
    assert torch.equal(momentum["w"], torch.zeros(2))
    assert torch.equal(new_m["w"], torch.tensor([0.5, 0.5]))


def test_fractional_rounds_move_about_as_far_as_one_full_round():
    # Two half rounds (coverage 1/2, gradient already halved) vs one full round, same gradient,
    # with momentum carried in: the half rounds must not apply the momentum twice over.
    p0, m0, g = {"w": torch.tensor([0.0])}, {"w": torch.tensor([1.0])}, torch.tensor([1.0])
    full, _ = outer_step(p0, m0, {"w": g}, lr=0.7, mu=0.9, nesterov=True)
    half, m_half = outer_step(p0, m0, {"w": g / 2}, lr=0.7, mu=0.9, nesterov=True, fraction=0.5)
    half, _ = outer_step(half, m_half, {"w": g / 2}, lr=0.7, mu=0.9, nesterov=True, fraction=0.5)
    plain, m_plain = outer_step(p0, m0, {"w": g / 2}, lr=0.7, mu=0.9, nesterov=True)
    plain, _ = outer_step(plain, m_plain, {"w": g / 2}, lr=0.7, mu=0.9, nesterov=True)
    gap_fractional = abs(half["w"] - full["w"]).item()
    gap_plain = abs(plain["w"] - full["w"]).item()
    assert gap_fractional < 0.1 * abs(full["w"]).item()
    assert gap_fractional < gap_plain / 3


def test_fraction_one_is_the_plain_step():
    p0, m0, g = {"w": torch.tensor([0.3])}, {"w": torch.tensor([0.2])}, {"w": torch.tensor([0.5])}
    for nesterov in (True, False):
        a = outer_step(p0, m0, g, lr=0.7, mu=0.9, nesterov=nesterov)
        b = outer_step(p0, m0, g, lr=0.7, mu=0.9, nesterov=nesterov, fraction=1.0)
        assert torch.equal(a[0]["w"], b[0]["w"]) and torch.equal(a[1]["w"], b[1]["w"])


# -- work fraction: how much of an outer step a round's momentum takes ----------------------------


def test_a_full_round_is_a_whole_step_and_a_short_one_its_share():
    assert work_fraction(2 * 100, 2, 100) == 1.0  # both learners, H steps each
    assert work_fraction(100, 2, 100) == 0.5  # one of two learners: its coverage
    assert work_fraction(3 + 3, 2, 100) == pytest.approx(0.03)  # an end-game round of 3 steps each
    assert work_fraction(400, 2, 100) == 1.0  # a skipped push's double interval: never above one
    assert work_fraction(0, 2, 100) == 0.0


def test_rounds_of_few_steps_no_longer_each_take_a_whole_momentum_step():
    """Momentum built up over full rounds, then ten rounds of 3 steps each (an end game): with the
    work fraction they move the model about as far as their steps' worth, not ten momentum steps."""
    params, momentum = {"w": torch.tensor([0.0])}, {"w": torch.tensor([0.0])}
    for _ in range(5):
        params, momentum = outer_step(params, momentum, {"w": torch.tensor([1.0])}, 0.7, 0.9, True)
    before = params["w"].clone()
    whole, short = dict(params), dict(params)
    m_whole, m_short = dict(momentum), dict(momentum)
    for _ in range(10):
        g = {"w": torch.tensor([0.03])}  # a mean delta of 3 steps: already small
        whole, m_whole = outer_step(whole, m_whole, g, 0.7, 0.9, True)
        short, m_short = outer_step(short, m_short, g, 0.7, 0.9, True, fraction=work_fraction(6, 2, 100))
    assert float(before - whole["w"]) > 10.0  # ten whole momentum kicks of a 4.1 buffer
    assert 0 < float(before - short["w"]) < 2.5  # ≈ 0.3 of a round of momentum, plus the steps


def test_running_statistics_take_the_mean_of_their_values_and_no_momentum():
    """Running statistics come as the pushes' values (g: their mean times the round's share s):
    θ ← (1 − s)·θ + g, no momentum. As deltas under the outer step a variance that fell from 1.0
    to 0.01 would go to −0.32, and a delta against an older base could too."""
    params = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    stats = frozenset({"bn.running_var"})
    grad = {"w": torch.tensor([0.99]), "bn.running_var": torch.tensor([0.01])}  # learners' variance 0.01
    new, m = outer_step(params, momentum, grad, 0.7, 0.9, True, averaged=stats)
    assert new["bn.running_var"].item() == pytest.approx(0.01) and m["bn.running_var"].item() == 0.0
    assert new["w"].item() == pytest.approx(1.0 - 0.7 * (0.99 + 0.9 * 0.99))  # the parameter's step
    half = {"w": torch.tensor([0.495]), "bn.running_var": torch.tensor([0.005])}  # a round of 1/2
    new, _ = outer_step(params, momentum, half, 0.7, 0.9, True, averaged=stats, share=0.5)
    assert new["bn.running_var"].item() == pytest.approx(0.505)  # halfway to the pushes' mean
    plain, _ = outer_step(params, momentum, {**grad, "bn.running_var": torch.tensor([0.99])}, 0.7, 0.9, True)
    assert plain["bn.running_var"].item() < 0  # what the outer step would make of it as a delta


def test_running_statistics_fold_as_a_weighted_mean_in_every_mode():
    for mode in ("mean", "token", "rda"):
        acc = MergeAccumulator(mode, plain=frozenset({"v"}))
        acc.add({"v": torch.tensor([2.0, 4.0])}, 1.0, age=0.5)
        acc.add({"v": torch.tensor([4.0, 8.0])}, 1.0)
        assert torch.allclose(acc.result(1.0)["v"], torch.tensor([3.0, 6.0])), mode  # no age, no rda
