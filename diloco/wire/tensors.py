"""Tensors <-> streamed proto messages.

A stream is one TensorHeader (names, dtypes, shapes and the push/pull metadata) followed by
TensorPieces, each a slice of one tensor's raw little-endian bytes no larger than the configured
piece size, so no single message comes near the gRPC limit. The receiver checks every piece
against the header before it allocates or copies anything: a wrong shape, dtype, offset or size is
refused with a clear reason, never half-applied.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from diloco.v1 import coordinator_pb2 as pb

# Raw bytes on the wire are little-endian; every platform torch ships on is too.
assert sys.byteorder == "little", "diloco's wire format assumes a little-endian host"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
    """A stream that does not match its header or the expected tensors."""


def spec_of(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} of {name} cannot travel on the wire")
    return pb.TensorSpec(name=name, dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape))


def nbytes_of(spec: pb.TensorSpec) -> int:
    count = 1
    for d in spec.shape:
        count *= int(d)
    return count * torch.empty((), dtype=DTYPES[spec.dtype]).element_size()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw bytes without a copy when it is already a contiguous CPU tensor."""
    t = tensor.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def stream_tensors(
    header: pb.TensorHeader,
    tensors: Mapping[str, torch.Tensor],
    piece_bytes: int,
    averaged: frozenset[str] = frozenset(),
) -> Iterator[pb.TensorStreamMessage]:
    """Header then pieces. `header.tensors` is filled from `tensors` (in their order); those named
    in `averaged` are marked so (running statistics: only the initial parameters say it)."""
    del header.tensors[:]
    header.tensors.extend(spec_of(name, t) for name, t in tensors.items())
    for spec in header.tensors:
        spec.averaged = spec.name in averaged
    yield pb.TensorStreamMessage(header=header)
    for index, t in enumerate(tensors.values()):
        raw = tensor_bytes(t)
        for offset in range(0, len(raw), piece_bytes):
            piece = pb.TensorPiece(
                tensor=index, offset=offset, data=bytes(raw[offset : offset + piece_bytes])
            )
            yield pb.TensorStreamMessage(piece=piece)


def stream_many(
    parts: Iterable[tuple[pb.TensorHeader, Mapping[str, torch.Tensor]]], piece_bytes: int
) -> Iterator[pb.TensorStreamMessage]:
    """Several header+pieces groups in one stream (a pull of several fragments)."""
    for header, tensors in parts:
        yield from stream_tensors(header, tensors, piece_bytes)


class PieceMessage:
    """A TensorStreamMessage holding a piece, read in place from its serialized bytes.

    `data` is a view of the received buffer: upb would copy a piece's megabyte once to parse it
    and again on every access of `data`. Stream readers ask a message two things,
    `WhichOneof("kind")` and `.piece`; this answers both.
    """

    __slots__ = ("tensor", "offset", "data")

    def __init__(self, tensor: int, offset: int, data: memoryview) -> None:
        self.tensor, self.offset, self.data = tensor, offset, data

    def WhichOneof(self, group: str) -> str:  # noqa: N802 (the protobuf method's name)
        return "piece"

    @property
    def piece(self) -> PieceMessage:
        return self


_PIECE_TAG = (2 << 3) | 2  # TensorStreamMessage.piece: field 2, length-delimited
_TENSOR_TAG, _OFFSET_TAG, _DATA_TAG = (1 << 3) | 0, (2 << 3) | 0, (3 << 3) | 2  # TensorPiece's


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def parse_stream_message(raw: bytes) -> pb.TensorStreamMessage | PieceMessage:
    """`TensorStreamMessage.FromString`, except that a piece in the layout every protobuf
    serializer writes (one `piece` field holding tensor, offset, data) comes back as a
    PieceMessage over `raw`, without a copy. Anything else is left to protobuf itself."""
    buf = memoryview(raw)
    try:
        if not buf or buf[0] != _PIECE_TAG:
            raise IndexError
        length, pos = _varint(buf, 1)
        if pos + length != len(buf):
            raise IndexError
        tensor = offset = 0
        data = buf[0:0]
        while pos < len(buf):
            tag = buf[pos]
            if tag == _TENSOR_TAG:
                tensor, pos = _varint(buf, pos + 1)
            elif tag == _OFFSET_TAG:
                offset, pos = _varint(buf, pos + 1)
            elif tag == _DATA_TAG:
                size, pos = _varint(buf, pos + 1)
                if pos + size > len(buf):
                    raise IndexError
                data, pos = buf[pos : pos + size], pos + size
            else:  # a field this fast path does not know: protobuf decides
                raise IndexError
        if tensor >= 1 << 32:
            raise IndexError
        return PieceMessage(tensor, offset, data)
    except IndexError:
        return pb.TensorStreamMessage.FromString(raw)


def sq_norm(t: torch.Tensor) -> float:
    """x·x of a float tensor in one BLAS dot on this thread: the squared norm, and a finiteness
    check in the same pass (NaN or inf when any value is, or when |x| > ~1e19, which no sane delta
    or parameter is). numpy, not torch: torch's reductions start an OpenMP team from each gRPC
    handler thread at once and oversubscribe the cores."""
    array = t.detach().reshape(-1)
    if array.dtype not in (torch.float32, torch.float64):
        array = array.float()
    values = array.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(values, values))


class TensorAssembler:
    """Rebuilds the tensors of one header from its pieces, validating as it goes.

    With `finite`, floating-point values are checked for NaN and ±inf piece by piece, right after
    each piece is copied in (while it is still in cache), instead of in one more pass over the whole
    tensor once it is assembled.
    """

    def __init__(
        self,
        header: pb.TensorHeader,
        max_bytes: int,
        expected: Mapping[str, pb.TensorSpec] | None = None,
        finite: bool = False,
    ):
        self.header = header
        self.finite = finite
        # With `finite`: Σ x·x over every value checked, when all are fp32 (each piece's check is
        # that dot): the squared norm comes free. None when some tensor is of another dtype.
        self.sq_norm: float | None = 0.0
        names = [s.name for s in header.tensors]
        if len(set(names)) != len(names):
            raise WireError("duplicate tensor names in header")
        for spec in header.tensors:
            if spec.dtype not in DTYPES:
                raise WireError(f"unknown dtype {spec.dtype!r} for {spec.name}")
            if any(d < 0 for d in spec.shape):
                raise WireError(f"negative dimension in {spec.name}")
        if expected is not None:
            _check_matches(header.tensors, expected)
        self._sizes = [nbytes_of(s) for s in header.tensors]
        total = sum(self._sizes)
        if total > max_bytes:
            raise WireError(f"stream of {total} bytes is over the limit of {max_bytes}")
        # Uninitialised: every byte is written by a piece before `tensors()` hands it out.
        self._buffers = [torch.empty(n, dtype=torch.uint8) for n in self._sizes]
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self._filled = [0] * len(self._sizes)
        self._checked = [0] * len(self._sizes)  # bytes of each tensor found finite so far

    def add(self, piece: pb.TensorPiece | PieceMessage) -> None:
        if piece.tensor >= len(self._buffers):
            raise WireError(f"piece for tensor #{piece.tensor}, header has {len(self._buffers)}")
        buf = self._views[piece.tensor]
        data = piece.data  # upb copies a bytes field on every access: once per piece
        end = piece.offset + len(data)
        if end > len(buf) or piece.offset != self._filled[piece.tensor]:
            raise WireError(
                f"piece at offset {piece.offset} out of order or past the end of {self.header.tensors[piece.tensor].name}"
            )
        buf[piece.offset : end] = data
        self._filled[piece.tensor] = end
        if self.finite:
            self._check_finite(piece.tensor)

    def _check_finite(self, index: int) -> None:
        dtype = DTYPES[self.header.tensors[index].dtype]
        if not dtype.is_floating_point:
            self.sq_norm = None
            return
        size = dtype.itemsize
        start, end = self._checked[index], self._filled[index] // size * size  # whole values only
        if end <= start:
            return
        values = self._buffers[index][start:end].view(dtype)
        # numpy on this thread alone: torch's reduction would start an OpenMP team from every
        # gRPC handler thread at once and oversubscribe the cores (measured 10x slower).
        with np.errstate(over="ignore", invalid="ignore"):
            if dtype in (torch.bfloat16, torch.float16):
                # Half precision (rare on the wire): a sum in float32, which holds any of them.
                reduced = values.float().numpy().sum()
                self.sq_norm = None
            else:
                # x·x is NaN or inf when any value is (or when |x| > ~1e19, which no sane delta
                # is): one BLAS dot over the piece just copied, 3x faster than numpy's sum.
                array = values.numpy()
                reduced = np.dot(array, array)
        if not np.isfinite(reduced):
            raise WireError(f"non-finite (or absurdly large) values in {self.header.tensors[index].name}")
        if self.sq_norm is not None:
            self.sq_norm = None if dtype != torch.float32 else self.sq_norm + float(reduced)
        self._checked[index] = end

    @property
    def complete(self) -> bool:
        return self._filled == self._sizes

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self.complete:
            missing = [
                s.name
                for s, f, n in zip(self.header.tensors, self._filled, self._sizes, strict=True)
                if f != n
            ]
            raise WireError(f"stream ended before all bytes arrived (incomplete: {', '.join(missing[:3])})")
        out: dict[str, torch.Tensor] = {}
        for spec, flat in zip(self.header.tensors, self._buffers, strict=True):
            out[spec.name] = flat.view(DTYPES[spec.dtype]).reshape(tuple(spec.shape))
        return out


def receive_groups(
    messages: Iterable[pb.TensorStreamMessage], max_bytes: int
) -> Iterator[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
    """Split a stream into (header, tensors) groups, each fully validated."""
    current: TensorAssembler | None = None
    for msg in messages:
        kind = msg.WhichOneof("kind")
        if kind == "header":
            if current is not None:
                yield current.header, current.tensors()
            current = TensorAssembler(msg.header, max_bytes)
        elif kind == "piece":
            if current is None:
                raise WireError("tensor piece before any header")
            current.add(msg.piece)
        else:
            raise WireError("empty stream message")
    if current is not None:
        yield current.header, current.tensors()


def receive_one(
    messages: Iterable[pb.TensorStreamMessage],
    max_bytes: int,
    expected: Mapping[str, pb.TensorSpec] | None = None,
) -> tuple[pb.TensorHeader, dict[str, torch.Tensor]]:
    """Exactly one header+pieces group (a push or an init)."""
    it = iter(messages)
    first = next(it, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise WireError("stream must start with a header")
    asm = TensorAssembler(first.header, max_bytes, expected)
    for msg in it:
        if msg.WhichOneof("kind") != "piece":
            raise WireError("only one header is allowed in this stream")
        asm.add(msg.piece)
    return asm.header, asm.tensors()


def _check_matches(specs: Iterable[pb.TensorSpec], expected: Mapping[str, pb.TensorSpec]) -> None:
    got = {s.name: s for s in specs}
    if set(got) != set(expected):
        extra = sorted(set(got) - set(expected))
        missing = sorted(set(expected) - set(got))
        raise WireError(
            f"tensor names differ from the model's (unexpected: {extra[:3]}, missing: {missing[:3]})"
        )
    for name, spec in got.items():
        want = expected[name]
        if spec.dtype != want.dtype or list(spec.shape) != list(want.shape):
            raise WireError(
                f"{name}: got {spec.dtype}{list(spec.shape)}, expected {want.dtype}{list(want.shape)}"
            )
