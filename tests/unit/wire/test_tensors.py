"""Tensor streaming on the wire: round trips, every malformed stream refused, the finite check."""

import math

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import (
    DTYPES,
    PieceMessage,
    TensorAssembler,
    WireError,
    parse_stream_message,
    receive_groups,
    receive_one,
    spec_of,
    sq_norm,
    stream_many,
    stream_tensors,
)

BIG = 1 << 30


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(4, generator=gen).to(torch.bfloat16),
        "i8": torch.randint(-128, 128, (2, 3, 2), generator=gen, dtype=torch.int8),
        "scalar": torch.tensor(-7, dtype=torch.int8),
        "empty": torch.empty(0, 4),
        "noncontig": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert tuple(got[name].shape) == tuple(t.shape), name
        assert raw(got[name]) == raw(t), name


def messages(tensors, piece=7, **header):
    return list(stream_tensors(pb.TensorHeader(**header), tensors, piece))


# -- wire ---------------------------------------------------------------------------------------------


def test_round_trip_with_tiny_pieces():
    tensors = sample_tensors()
    msgs = messages(tensors, piece=7, worker_id="w1", fragment=2, version=9, push_id="p")
    pieces = [m.piece for m in msgs[1:]]
    assert msgs[0].WhichOneof("kind") == "header"
    assert all(m.WhichOneof("kind") == "piece" for m in msgs[1:])
    assert all(0 < len(p.data) <= 7 for p in pieces)
    total = sum(len(raw(t)) for t in tensors.values())
    assert sum(len(p.data) for p in pieces) == total
    assert len(pieces) >= total // 7
    header, got = receive_one(msgs, max_bytes=BIG)
    assert (header.worker_id, header.fragment, header.version, header.push_id) == ("w1", 2, 9, "p")
    assert_same(got, tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_zero_dim_round_trip(dtype):
    tensors = {"scalar": torch.tensor(3, dtype=dtype)}
    _, got = receive_one(messages(tensors, piece=3), max_bytes=BIG)
    assert_same(got, tensors)


def test_round_trip_keeps_nan_and_inf_bits():
    t = {"x": torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])}
    _, got = receive_one(messages(t, piece=3), max_bytes=BIG)
    assert raw(got["x"]) == raw(t["x"])


def test_expected_specs_accepted_when_matching():
    tensors = sample_tensors()
    expected = {n: spec_of(n, t) for n, t in tensors.items()}
    _, got = receive_one(messages(tensors), max_bytes=BIG, expected=expected)
    assert_same(got, tensors)


@pytest.mark.parametrize(
    "wrong",
    [torch.zeros(3, 6), torch.zeros(3, 5, dtype=torch.float16), torch.zeros(15)],
    ids=["shape", "dtype", "flattened"],
)
def test_expected_shape_or_dtype_mismatch_refused(wrong):
    tensors = {"w": torch.zeros(3, 5), "b": torch.zeros(5)}
    expected = {"w": spec_of("w", wrong), "b": spec_of("b", tensors["b"])}
    with pytest.raises(WireError, match="w"):
        receive_one(messages(tensors), max_bytes=BIG, expected=expected)


def test_expected_names_mismatch_refused():
    tensors = {"w": torch.zeros(2)}
    with pytest.raises(WireError, match="names"):
        receive_one(messages(tensors), max_bytes=BIG, expected={"v": spec_of("v", torch.zeros(2))})


def test_unknown_dtype_refused():
    header = pb.TensorHeader(tensors=[pb.TensorSpec(name="x", dtype="complex64", shape=[2])])
    msgs = [
        pb.TensorStreamMessage(header=header),
        pb.TensorStreamMessage(piece=pb.TensorPiece(tensor=0, data=b"\0" * 16)),
    ]
    with pytest.raises(WireError, match="dtype"):
        receive_one(msgs, max_bytes=BIG)
    with pytest.raises(WireError, match="dtype"):
        list(receive_groups(msgs, max_bytes=BIG))


def test_tensor_with_unsupported_dtype_cannot_be_sent():
    with pytest.raises(WireError):
        list(stream_tensors(pb.TensorHeader(), {"c": torch.zeros(2, dtype=torch.complex64)}, 8))


def test_duplicate_names_in_header_refused():
    spec = pb.TensorSpec(name="x", dtype="float32", shape=[1])
    header = pb.TensorHeader(tensors=[spec, spec])
    with pytest.raises(WireError, match="duplicate"):
        receive_one([pb.TensorStreamMessage(header=header)], max_bytes=BIG)


def test_out_of_order_pieces_refused():
    msgs = messages({"x": torch.arange(10, dtype=torch.float32)}, piece=8)
    msgs[1], msgs[2] = msgs[2], msgs[1]
    with pytest.raises(WireError, match="offset"):
        receive_one(msgs, max_bytes=BIG)


def test_overlapping_piece_refused():
    msgs = messages({"x": torch.arange(10, dtype=torch.float32)}, piece=8)
    msgs.insert(3, msgs[2])  # the same piece twice
    with pytest.raises(WireError, match="offset"):
        receive_one(msgs, max_bytes=BIG)


def test_piece_past_the_end_refused():
    header = pb.TensorHeader(tensors=[pb.TensorSpec(name="x", dtype="int8", shape=[4])])
    msgs = [
        pb.TensorStreamMessage(header=header),
        pb.TensorStreamMessage(piece=pb.TensorPiece(tensor=0, data=b"12345")),
    ]
    with pytest.raises(WireError):
        receive_one(msgs, max_bytes=BIG)


def test_piece_for_missing_tensor_refused():
    msgs = messages({"x": torch.zeros(2)})
    msgs.append(pb.TensorStreamMessage(piece=pb.TensorPiece(tensor=1, offset=0, data=b"\0")))
    with pytest.raises(WireError, match="#1"):
        receive_one(msgs, max_bytes=BIG)


def test_stream_over_max_bytes_refused():
    tensors = {"a": torch.zeros(10), "b": torch.zeros(6, dtype=torch.int8)}  # 46 bytes
    _, got = receive_one(messages(tensors), max_bytes=46)
    assert_same(got, tensors)
    with pytest.raises(WireError, match="limit"):
        receive_one(messages(tensors), max_bytes=45)
    with pytest.raises(WireError, match="limit"):
        list(receive_groups(messages(tensors), max_bytes=45))


def test_huge_declared_shape_refused_before_allocation():
    header = pb.TensorHeader(tensors=[pb.TensorSpec(name="x", dtype="float64", shape=[1 << 20, 1 << 20])])
    with pytest.raises(WireError, match="limit"):
        receive_one([pb.TensorStreamMessage(header=header)], max_bytes=BIG)


def test_stream_ending_early_refused():
    msgs = messages({"a": torch.arange(5, dtype=torch.float32), "b": torch.ones(3)}, piece=4)
    with pytest.raises(WireError, match="incomplete"):
        receive_one(msgs[:-1], max_bytes=BIG)
    with pytest.raises(WireError, match="incomplete"):
        list(receive_groups(msgs[:-1], max_bytes=BIG))
    with pytest.raises(WireError, match="incomplete"):
        receive_one(msgs[:1], max_bytes=BIG)  # the header alone


def test_piece_before_header_refused():
    msgs = messages({"x": torch.ones(4)})
    with pytest.raises(WireError, match="header"):
        receive_one(msgs[1:], max_bytes=BIG)
    with pytest.raises(WireError, match="header"):
        list(receive_groups(msgs[1:], max_bytes=BIG))
    with pytest.raises(WireError, match="header"):
        receive_one([], max_bytes=BIG)


def test_second_header_refused_in_single_group_stream():
    msgs = messages({"x": torch.ones(1)}) + messages({"y": torch.ones(1)})
    with pytest.raises(WireError, match="one header"):
        receive_one(msgs, max_bytes=BIG)


def test_empty_message_refused():
    with pytest.raises(WireError):
        list(receive_groups([pb.TensorStreamMessage()], max_bytes=BIG))


def test_receive_groups_splits_multi_group_stream():
    parts = [
        (pb.TensorHeader(fragment=0, version=4), {"a": torch.arange(6, dtype=torch.float32)}),
        (
            pb.TensorHeader(fragment=1, version=7),
            {"b": torch.ones(2, 2, dtype=torch.bfloat16), "c": torch.ones(1)},
        ),
        (pb.TensorHeader(fragment=2, version=1), {}),
    ]
    groups = list(receive_groups(stream_many(parts, 5), max_bytes=BIG))
    assert [(h.fragment, h.version) for h, _ in groups] == [(0, 4), (1, 7), (2, 1)]
    for (_, got), (_, want) in zip(groups, parts, strict=True):
        assert_same(got, want)
    assert list(receive_groups([], max_bytes=BIG)) == []


@st.composite
def tensor_dicts(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    out = {}
    for i in range(draw(st.integers(0, 4))):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)
        out[f"t{i}"] = t
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tensors=tensor_dicts(), piece=st.integers(1, 64))
def test_round_trip_property(tensors, piece):
    msgs = messages(tensors, piece=piece)
    assert all(len(m.piece.data) <= piece for m in msgs[1:])
    _, got = receive_one(msgs, max_bytes=BIG)
    assert_same(got, tensors)
    # The same stream, read as groups, gives the same single group.
    ((_, again),) = list(receive_groups(msgs, max_bytes=BIG))
    assert_same(again, tensors)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_assembler_refuses_non_finite_values_piece_by_piece(bad):
    x = torch.arange(40, dtype=torch.float32)
    x[29] = bad
    # Pieces of 7 bytes: values straddle piece boundaries, and each is still checked once whole.
    msgs = messages({"ok": torch.ones(3), "x": x}, piece=7)
    asm = TensorAssembler(msgs[0].header, BIG, finite=True)
    with pytest.raises(WireError, match="non-finite .* in x"):
        for m in msgs[1:]:
            asm.add(m.piece)
    # Without the check (a pull, say) the same bytes assemble as they are.
    assert receive_one(messages({"x": x}, piece=7), max_bytes=BIG)[1]["x"][29].item() != 0


def test_assembler_finite_check_passes_finite_floats_and_ignores_integers():
    tensors = {
        "w": torch.randn(33),
        "ids": torch.tensor([2**31 - 1, -5], dtype=torch.int32),
        # Large but finite half-precision values: their squares would not fit the type itself.
        "h": torch.tensor([300.0, -60000.0], dtype=torch.float16),
        "b": torch.tensor([1e30, -3e38], dtype=torch.bfloat16),
    }
    msgs = messages(tensors, piece=5)
    asm = TensorAssembler(msgs[0].header, BIG, finite=True)
    for m in msgs[1:]:
        asm.add(m.piece)
    assert all(torch.equal(asm.tensors()[n], t) for n, t in tensors.items())


@settings(max_examples=200, deadline=None)
@given(
    tensor=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=300),
)
def test_pieces_parse_in_place_exactly_as_protobuf_parses_them(tensor, offset, data):
    raw = pb.TensorStreamMessage(
        piece=pb.TensorPiece(tensor=tensor, offset=offset, data=data)
    ).SerializeToString()
    msg = parse_stream_message(raw)
    assert isinstance(msg, PieceMessage), "a plain piece takes the in-place path"
    assert msg.WhichOneof("kind") == "piece"
    assert (msg.piece.tensor, msg.piece.offset, bytes(msg.piece.data)) == (tensor, offset, data)


def test_messages_off_the_fast_path_are_parsed_by_protobuf():
    header = pb.TensorStreamMessage(header=pb.TensorHeader(fragment=3, push_id="p"))
    assert parse_stream_message(header.SerializeToString()) == header
    piece = pb.TensorStreamMessage(piece=pb.TensorPiece(tensor=1, offset=8, data=b"abcd"))
    raw = piece.SerializeToString()
    # Fields in another order, a field repeated (the last wins) and an unknown field: all legal
    # protobuf, and each must read as protobuf reads it.
    inner = bytes([0x1A, 2]) + b"zz" + bytes([0x10, 8, 0x08, 1, 0x1A, 4]) + b"abcd"
    reordered = bytes([0x12, len(inner)]) + inner
    assert parse_stream_message(reordered).piece.data == b"abcd"
    unknown = bytes([0x12, len(inner) + 2]) + inner + bytes([0x20, 7])  # field 4, varint
    parsed = parse_stream_message(unknown)
    assert not isinstance(parsed, PieceMessage)
    assert (parsed.piece.tensor, parsed.piece.offset, parsed.piece.data) == (1, 8, b"abcd")
    # Cut short: protobuf's own error, never a piece with half its bytes.
    with pytest.raises(DecodeError):
        parse_stream_message(raw[:-1])
    assert parse_stream_message(raw).piece.data == b"abcd"


def assembled(tensors: dict[str, torch.Tensor], piece: int) -> TensorAssembler:
    first, *rest = [parse_stream_message(m.SerializeToString()) for m in messages(tensors, piece)]
    asm = TensorAssembler(first.header, BIG, finite=True)
    for m in rest:
        asm.add(m.piece)
    return asm


@pytest.mark.parametrize("piece", [7, 64, 1 << 20])
def test_the_finite_check_gives_the_squared_norm_of_fp32_tensors(piece: int) -> None:
    # The push's outlier check takes its norm from here instead of one more pass over the delta.
    gen = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(33, 7, generator=gen), "b": torch.randn(1000, generator=gen) * 1e-3}
    asm = assembled(tensors, piece)
    want = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values())
    assert asm.sq_norm == pytest.approx(want, rel=1e-5)
    assert sq_norm(tensors["a"]) == pytest.approx(float(tensors["a"].double().square().sum()), rel=1e-5)
    # Another dtype on the wire: no norm from the check (the caller computes it).
    assert assembled({**tensors, "h": torch.ones(3, dtype=torch.bfloat16)}, piece).sq_norm is None


def test_sq_norm_is_not_finite_when_a_value_is_not() -> None:
    for bad in (math.nan, math.inf, 1e20):
        assert not math.isfinite(sq_norm(torch.tensor([1.0, bad, 2.0])))
