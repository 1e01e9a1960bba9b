"""The pull codec's two sides: what the coordinator encodes, a learner decodes to the same tensors."""

import torch

from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.steps import decode_steps, encode_steps, steps_since


def as_parts(chain_steps, codec):
    return [
        (
            pb.TensorHeader(fragment=0, version=v, delta=True, codec=codec),
            {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in blobs.items()},
        )
        for v, blobs in chain_steps
    ]


def test_a_learner_adding_the_steps_holds_exactly_what_the_coordinator_broadcast():
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(64, 8, generator=gen), "b": torch.randn(8, generator=gen)}
    broadcast, chain = dict(start), {}
    for version in (1, 2, 3):  # three published versions, each a step from the last
        params = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in broadcast.items()}
        blobs, broadcast = encode_steps(params, broadcast, "int8", 3)
        chain[version] = (version - 1, blobs)
    got = decode_steps(start, 0, as_parts(steps_since(chain, 3, 0), "int8"))
    for name in start:
        assert torch.equal(got[name], broadcast[name])  # bit for bit: no drift between the sides


def test_steps_since_walks_back_only_as_far_as_the_chain_reaches():
    chain = {2: (1, {"w": b"x"}), 3: (2, {"w": b"y"})}
    assert [v for v, _ in steps_since(chain, 3, 1)] == [2, 3]
    assert steps_since(chain, 3, 3) == []  # up to date: nothing to send
    assert steps_since(chain, 3, 0) is None  # too far back: the fragment goes whole


def test_steps_that_do_not_follow_the_version_held_are_refused():
    parts = as_parts([(5, {"w": b"\x00"})], "int8")
    assert decode_steps({"w": torch.zeros(2)}, 3, parts) is None
    whole = [(pb.TensorHeader(fragment=0, version=7, codec="fp32"), {"w": torch.ones(2)})]
    assert torch.equal(decode_steps({"w": torch.zeros(2)}, 3, whole)["w"], torch.ones(2))
