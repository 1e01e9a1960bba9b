"""The fragment plan: which parameters each fragment holds, for the built-in GPT and by hand."""

import pytest

from diloco.config import ModelConfig
from diloco.fragments import assign_fragments, is_embedding

# -- fragments ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_sizes():
    from diloco.model import build_model

    model = build_model(ModelConfig(), 257, 0)
    return [(n, p.numel()) for n, p in model.named_parameters()]


def test_one_fragment_holds_everything_in_order(gpt_sizes):
    assert assign_fragments(gpt_sizes, 1) == [[n for n, _ in gpt_sizes]]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_fragments_of_the_gpt(gpt_sizes, P):
    frags = assign_fragments(gpt_sizes, P)
    names = [n for n, _ in gpt_sizes]
    assert len(frags) == P
    # Every name exactly once, each fragment in model order.
    assert sorted(n for f in frags for n in f) == sorted(names)
    for f in frags:
        assert f == [n for n in names if n in set(f)]
    # Embeddings alone in fragment 0.
    embeddings = [n for n in names if "wte" in n or "wpe" in n]
    assert embeddings
    assert frags[0] == embeddings
    assert not any(is_embedding(n) for f in frags[1:] for n in f)
    # The others balanced.
    size = dict(gpt_sizes)
    loads = [sum(size[n] for n in f) for f in frags[1:]]
    assert min(loads) > 0
    assert max(loads) / min(loads) <= 1.1
    # Deterministic.
    assert assign_fragments(gpt_sizes, P) == frags
    assert assign_fragments(list(gpt_sizes), P) == frags


def test_greedy_hand_case():
    # Largest first into the lightest bin: a->0 (10), b->1 (8), c->1 (13), d->0 (14), e->1 (16).
    tensors = [("e", 3), ("a", 10), ("d", 4), ("b", 8), ("c", 5)]
    assert assign_fragments(tensors, 2) == [["a", "d"], ["e", "b", "c"]]


def test_embeddings_take_fragment_zero_in_a_small_model():
    tensors = [("wte.weight", 100), ("h.0.w", 10), ("h.1.w", 10), ("lm_head.weight", 100), ("ln_f", 1)]
    frags = assign_fragments(tensors, 3)
    assert frags[0] == ["wte.weight", "lm_head.weight"]
    assert sorted(frags[1] + frags[2]) == ["h.0.w", "h.1.w", "ln_f"]


def test_fragment_errors():
    with pytest.raises(ValueError):
        assign_fragments([("a", 1)], 0)
    with pytest.raises(ValueError, match="unique"):
        assign_fragments([("a", 1), ("a", 2)], 2)
    with pytest.raises(ValueError, match="cannot split"):
        assign_fragments([("wte", 5), ("a", 1)], 3)
