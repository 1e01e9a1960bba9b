"""The syncer's pure decisions: outer Nesterov step, merge weights and modes, when a round closes."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.config import SyncConfig
from diloco.coordinator.syncer import (
    Arrival,
    MergeAccumulator,
    RoundState,
    age_factor,
    coverage_scale,
    decide_close,
    grace_window,
    late_in_round_by,
    merge,
    merge_weight,
    merge_weights,
    missed_round_by,
    outer_hyper,
    outer_step,
    quorum_needed,
    staleness_refusal,
    work_fraction,
)


def sync_config(**changes) -> SyncConfig:
    """A SyncConfig that only does what a test asks: every live learner, no grace window, no
    overlap, plain mean, no stale push."""
    base = {"quorum": 0, "merge": "mean", "grace_factor": 0.0, "overlap_steps": 0, "max_staleness": 0}
    return SyncConfig(**{**base, **changes})


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


# -- closing a round ------------------------------------------------------------------------------


def arrival(worker, at, tokens=100, steps=10, base=0):
    return Arrival(worker_id=worker, tokens=tokens, steps=steps, arrived_at=at, base_version=base)


LIVE3 = {"a", "b", "c"}


def test_quorum_needed():
    assert quorum_needed(sync_config(quorum=0), 3) == 3
    assert quorum_needed(sync_config(quorum=1), 3) == 1
    assert quorum_needed(sync_config(quorum=5), 3) == 3  # never more than are alive
    assert quorum_needed(sync_config(quorum=0), 0) == 1


def test_quorum_one_closes_on_first_push():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0)])
    decision = decide_close(state, now=1.0, policy=sync_config(quorum=1), live_learners=LIVE3)
    assert decision.close


def test_quorum_all_waits_for_every_live_learner():
    policy = sync_config(quorum=0)
    state = RoundState(fragment=0, version=0, opened_at=0.0)
    state.arrivals.append(arrival("a", 1.0))
    assert not decide_close(state, 100.0, policy, LIVE3).close
    state.arrivals.append(arrival("b", 2.0))
    d = decide_close(state, 100.0, policy, LIVE3)
    assert not d.close
    assert "2/3" in d.reason
    state.arrivals.append(arrival("c", 3.0))
    assert decide_close(state, 3.0, policy, LIVE3).close


def test_quorum_two_counts_distinct_learners():
    policy = sync_config(quorum=2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 2.0)])
    assert not decide_close(state, 5.0, policy, LIVE3).close
    state.arrivals.append(arrival("b", 3.0))
    assert decide_close(state, 5.0, policy, LIVE3).close


def test_the_first_round_after_a_restart_waits_for_the_pushes_it_dropped():
    """A restart dropped a's and b's pushes; each sends its own again at its next heartbeat. The
    round waits for both (bounded by awaited_until) instead of merging a's alone at quorum 1."""
    policy = sync_config(quorum=1, grace_factor=0.0)
    state = RoundState(fragment=0, version=3, opened_at=0.0, arrivals=[arrival("a", 1.0, base=3)])
    d = decide_close(state, 1.0, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0)
    assert not d.close and "1 push(es) the restart dropped" in d.reason and d.recheck_at == 6.0
    assert decide_close(state, 6.0, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0).close  # bounded
    # b came back: nothing else is awaited (c pushed nothing before the restart)
    state.arrivals.append(arrival("b", 2.5, base=3))
    assert decide_close(state, 2.5, policy, LIVE3, awaited={"a", "b"}, awaited_until=6.0).close
    # an awaited learner that is no longer live is not waited for
    alone = RoundState(fragment=0, version=3, opened_at=0.0, arrivals=[arrival("a", 1.0, base=3)])
    assert decide_close(alone, 1.0, policy, {"a", "c"}, awaited={"a", "b"}, awaited_until=6.0).close


def test_a_push_that_joins_a_round_late_is_told_by_how_much():
    """Both learners in every round, but one pushes seconds after the other (a restart put it
    behind): the late one hears its lag, unless it is jitter, there is no overlap, or the two
    step at different paces (different periods never line up)."""
    first = Arrival(worker_id="a", tokens=100, steps=10, arrived_at=10.0, base_version=3, step_time_s=0.3)
    # τ = 10 steps of 0.3 s: lags over 1.5 s count
    assert late_in_round_by(14.4, first, 0.3, 10) == pytest.approx(2.2)  # half: both may move
    assert late_in_round_by(11.0, first, 0.3, 10) == 0.0  # jitter
    assert late_in_round_by(14.4, first, 0.3, 0) == 0.0  # synchronous: no overlap
    assert late_in_round_by(14.4, first, 0.9, 10) == 0.0  # a learner 3x slower
    assert late_in_round_by(14.4, None, 0.3, 10) == 0.0


GRACE = sync_config(quorum=1, grace_factor=0.5, overlap_steps=10)


def test_grace_window_keeps_round_open_until_quorum_plus_window():
    # K = 1, first push at 2 is the quorum: slack = 10 steps * 1 s - 0 s - 0 s = 10 s;
    # window = 0.5 * 10 = 5 s -> close at 7.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=1.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(7.0)
    assert not decide_close(state, 6.99, GRACE, LIVE3, step_time_s=1.0).close
    d = decide_close(state, 7.0, GRACE, LIVE3, step_time_s=1.0)
    assert d.close
    assert d.recheck_at is None


def test_grace_window_shrinks_with_sync_time():
    # slack = 10*1 - 0 - 4 = 6; window = 3 -> close at 5.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=1.0, sync_time_s=4.0)
    assert d.recheck_at == pytest.approx(5.0)


def test_grace_window_spends_what_reaching_quorum_left():
    # K = 2: first push at 1, quorum at 3 -> time to quorum 2 s; slack = 10 - 2 = 8; window 4 -> close at 7.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 2.0)])
    assert decide_close(state, 2.5, policy, LIVE3, step_time_s=1.0).reason.startswith("1/2")
    state.arrivals.append(arrival("b", 3.0))
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(7.0)


def test_grace_window_uses_the_first_pushers_step_time():
    # The first pusher steps at 0.2 s: 10 steps of overlap = 2 s of slack, window 1 s, whatever the fallback.
    first = Arrival(worker_id="a", tokens=10, steps=1, arrived_at=2.0, base_version=0, step_time_s=0.2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[first])
    assert decide_close(state, 2.0, GRACE, LIVE3, step_time_s=5.0).recheck_at == pytest.approx(3.0)


def test_every_live_learner_pushed_closes_inside_grace_window():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    assert not decide_close(state, 2.5, GRACE, LIVE3, step_time_s=1.0).close
    state.arrivals += [arrival("b", 2.6), arrival("c", 2.7)]
    assert decide_close(state, 2.7, GRACE, LIVE3, step_time_s=1.0).close


def test_no_grace_window_without_factor_or_overlap():
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 2.0)])
    for policy in (
        sync_config(quorum=1, grace_factor=0.0, overlap_steps=10),
        sync_config(quorum=1, grace_factor=1.0),
    ):
        assert decide_close(state, 2.0, policy, LIVE3, step_time_s=1.0).close


def test_dead_learner_is_not_waited_for():
    # "c" was in the run but is no longer live: a synchronous round closes with a and b.
    policy = sync_config(quorum=0)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("b", 2.0)])
    assert not decide_close(state, 2.0, policy, LIVE3).close
    assert decide_close(state, 2.0, policy, {"a", "b"}).close


def test_push_from_learner_that_died_still_counts_for_quorum():
    # a pushed, then died; b is the only live one and has not pushed: with K = 1 the round closes.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0)])
    assert decide_close(state, 1.0, sync_config(quorum=1), {"b"}).close


def test_empty_round_never_closes():
    state = RoundState(fragment=0, version=0, opened_at=0.0)
    for policy in (sync_config(quorum=1), sync_config(quorum=0), GRACE):
        for live in (set(), LIVE3):
            d = decide_close(state, 1e9, policy, live, step_time_s=1.0)
            assert not d.close
            assert d.recheck_at is None


@pytest.mark.parametrize(
    ("factor", "overlap", "step", "ttq", "sync"),
    [(1.0, 0, 1.0, 5.0, 0.0), (0.5, 2, 1.0, 10.0, 3.0), (2.0, 1, 0.0, 0.0, 1.0), (0.0, 100, 1.0, 0.0, 0.0)],
)
def test_grace_window_never_negative(factor, overlap, step, ttq, sync):
    w = grace_window(sync_config(grace_factor=factor, overlap_steps=overlap), step, ttq, sync)
    assert w >= 0.0


def test_grace_window_value():
    assert grace_window(sync_config(grace_factor=0.5, overlap_steps=10), 2.0, 4.0, 6.0) == pytest.approx(5.0)


# -- staleness ------------------------------------------------------------------------------------


def test_zero_staleness_refuses_older_base():
    policy = sync_config(max_staleness=0)
    assert staleness_refusal(policy.max_staleness, 5, 5) is None
    reason = staleness_refusal(policy.max_staleness, 4, 5)
    assert reason is not None and "stale" in reason


def test_staleness_within_bound_accepted():
    policy = sync_config(max_staleness=2)
    assert staleness_refusal(policy.max_staleness, 3, 5) is None
    assert staleness_refusal(policy.max_staleness, 4, 5) is None
    assert staleness_refusal(policy.max_staleness, 2, 5) is not None


def test_base_newer_than_current_refused():
    reason = staleness_refusal(10, 6, 5)
    assert reason is not None and "newer" in reason


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


# -- a straggler's late push ----------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [1, 2, 16])
def test_straggler_late_push_accepted_within_staleness(max_staleness):
    # The round against version 2 closed and produced version 3; the open round is against
    # version 3 (it will produce version 4). A straggler's push based on version 2 arrives now:
    # it is one version stale.
    closed = RoundState(fragment=0, version=2, opened_at=0.0, arrivals=[arrival("a", 1.0, base=2)])
    assert decide_close(closed, 1.0, sync_config(quorum=1), LIVE3).close
    current = closed.version + 1
    policy = sync_config(quorum=1, max_staleness=max_staleness, grace_factor=0.0)
    assert staleness_refusal(policy.max_staleness, 2, current) is None

    late = arrival("b", 5.0, base=2)
    new_round = RoundState(fragment=0, version=current, opened_at=1.0, arrivals=[late])
    d = decide_close(new_round, 5.0, policy, LIVE3, step_time_s=1.0)
    assert d.close
    assert d.recheck_at is None


def test_straggler_late_push_refused_without_staleness():
    policy = sync_config(quorum=1, max_staleness=0)
    reason = staleness_refusal(policy.max_staleness, 2, 3)
    assert reason is not None
    assert "stale" in reason
    assert "2" in reason and "3" in reason


@pytest.mark.parametrize(
    ("base", "current", "max_staleness", "accepted"),
    [
        (2, 4, 1, False),  # two versions behind: one past the bound
        (2, 4, 2, True),
        (0, 16, 16, True),
        (0, 17, 16, False),
        (7, 7, 0, True),
    ],
)
def test_staleness_is_the_version_difference(base, current, max_staleness, accepted):
    reason = staleness_refusal(max_staleness, base, current)
    assert (reason is None) == accepted
    if not accepted:
        assert "stale" in reason


# -- quorum counts distinct learners --------------------------------------------------------------


def test_two_pushes_from_one_worker_do_not_make_quorum_two():
    policy = sync_config(quorum=2)
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[arrival("a", 1.0), arrival("a", 1.5)])
    d = decide_close(state, 100.0, policy, LIVE3)
    assert not d.close
    assert "1/2" in d.reason
    # Even if "a" is the only learner that ever pushes, repeated pushes never reach K = 2.
    state.arrivals += [arrival("a", float(t)) for t in range(2, 10)]
    assert not decide_close(state, 100.0, policy, LIVE3).close


def test_grace_window_quorum_time_is_needed_th_distinct_learner():
    # K = 2, gamma 0.5, tau 10 steps of 1 s. "a" pushes twice early (1.0, 1.5); "b" first at 4.0.
    # Quorum is reached at 4.0 (time to quorum 3 s), not 1.5: slack 10 - 3 = 7, window 3.5 -> 7.5.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(
        fragment=0,
        version=0,
        opened_at=0.0,
        arrivals=[arrival("a", 1.0), arrival("a", 1.5), arrival("b", 4.0)],
    )
    d = decide_close(state, 4.0, policy, LIVE3, step_time_s=1.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(7.5)
    assert not decide_close(state, 7.49, policy, LIVE3, step_time_s=1.0).close
    assert decide_close(state, 7.5, policy, LIVE3, step_time_s=1.0).close


def test_grace_window_quorum_time_uses_each_learners_first_push():
    # a at 1, b at 2, a again at 3: quorum at 2 (b's first), not 3. slack 10 - 1 = 9 -> window 4.5 -> 6.5.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    arrivals = [arrival("a", 1.0), arrival("b", 2.0), arrival("a", 3.0)]
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=arrivals)
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(6.5)
    # The list's order does not matter, only arrival times.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=arrivals[::-1])
    assert decide_close(state, 3.0, policy, LIVE3, step_time_s=1.0).recheck_at == pytest.approx(6.5)


# -- the step time the grace window uses ----------------------------------------------------------


def timed(worker, at, step_time_s):
    return Arrival(
        worker_id=worker, tokens=10, steps=1, arrived_at=at, base_version=0, step_time_s=step_time_s
    )


def test_grace_window_uses_first_pushers_step_time_not_a_later_ones():
    # K = 2; first pusher a (0.5 s/step) at 1, b (3 s/step) at 2. slack = 10*0.5 - 1 = 4 -> window 2 -> 4.
    policy = sync_config(quorum=2, grace_factor=0.5, overlap_steps=10)
    state = RoundState(
        fragment=0, version=0, opened_at=0.0, arrivals=[timed("b", 2.0, 3.0), timed("a", 1.0, 0.5)]
    )
    assert decide_close(state, 2.0, policy, LIVE3, step_time_s=7.0).recheck_at == pytest.approx(4.0)


def test_grace_window_falls_back_to_argument_when_arrival_step_time_zero():
    # The first pusher reports no step time: the argument (2 s) is used. slack 10*2 = 20 -> window 10 -> 12.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[timed("a", 2.0, 0.0)])
    d = decide_close(state, 2.0, GRACE, LIVE3, step_time_s=2.0)
    assert not d.close
    assert d.recheck_at == pytest.approx(12.0)
    # ... even if a later pusher reports one.
    state.arrivals.append(timed("b", 3.0, 0.1))
    assert decide_close(state, 3.0, GRACE, LIVE3, step_time_s=2.0).recheck_at == pytest.approx(12.0)
    # Neither known: no window, the round closes at quorum.
    state = RoundState(fragment=0, version=0, opened_at=0.0, arrivals=[timed("a", 2.0, 0.0)])
    assert decide_close(state, 2.0, GRACE, LIVE3, step_time_s=0.0).close


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


def test_a_push_that_opens_a_round_is_told_how_late_it_was_for_the_last_one():
    # The previous round's first push came at t = 100 from A; B's push opens the next at 100.6.
    assert missed_round_by(100.6, 100.0, {"A"}, "B", period_s=2.0) == pytest.approx(0.6)


def test_no_miss_for_a_pusher_that_was_in_the_last_round_or_without_one():
    assert missed_round_by(100.6, 100.0, {"A", "B"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(100.6, None, set(), "B", period_s=2.0) == 0.0
    assert missed_round_by(100.6, 100.0, {"A"}, "B", period_s=0.0) == 0.0  # no step time known


def test_a_push_half_a_period_or_more_after_is_early_for_the_next_round_not_late():
    assert missed_round_by(101.0, 100.0, {"A"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(101.5, 100.0, {"A"}, "B", period_s=2.0) == 0.0
    assert missed_round_by(100.99, 100.0, {"A"}, "B", period_s=2.0) == pytest.approx(0.99)


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


def test_a_short_overlap_keeps_the_grace_windows_gathering_slack():
    """τ = 2 applies merges sooner, but the window still spends grace_steps of the first pusher's
    steps gathering a round; a larger τ widens it, and τ = 0 (synchronous) has none."""
    assert SyncConfig(overlap_steps=2, grace_steps=10).gather_steps == 10
    assert SyncConfig(overlap_steps=20, grace_steps=10).gather_steps == 20
    assert SyncConfig(overlap_steps=0, grace_steps=10).gather_steps == 0
    short = sync_config(grace_factor=1.0, overlap_steps=2, grace_steps=10)
    assert grace_window(short, 0.5, 1.0, 0.5) == pytest.approx(3.5)  # 10 steps of 0.5 s, less 1.5 s
    first = Arrival(worker_id="a", tokens=10, steps=10, arrived_at=0.0, base_version=0, step_time_s=1.0)
    assert late_in_round_by(2.0, first, 1.0, short.gather_steps) == 0.0  # 2 s of 10 s slack: jitter
    assert late_in_round_by(6.0, first, 1.0, short.gather_steps) == pytest.approx(3.0)


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
