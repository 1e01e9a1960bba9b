"""Outer-gradient codecs: fp32, bf16, int8 and int4 (blockwise absmax), each then zstd.

A delta is a sum of many small steps: smooth, with a wide spread of magnitudes across tensors and
a narrow one inside a block of 64 values. Blockwise absmax keeps one bf16 scale per block, so
int8 costs ~1.03 and int4 ~0.53 bytes per parameter before zstd. The encoded blob of one tensor:

    zstd( u8 codec id | u32 numel | bf16 scales (int codecs) | values )

Decoding never trusts the blob: the element count must match the tensor the receiver expects, and
zstd output is bounded by the size that count implies.
"""

from __future__ import annotations

import struct

import torch
import zstandard

CODECS = ("fp32", "bf16", "int8", "int4")
BLOCK = 64
_IDS = {name: i for i, name in enumerate(CODECS)}
_HEAD = struct.Struct("<BI")


class CodecError(ValueError):
    """A blob that does not decode to the expected tensor."""


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def _quantize(flat: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(flat)
    scales = (blocks.abs().amax(dim=1) / qmax).to(torch.bfloat16)
    safe = scales.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = torch.round(blocks / safe).clamp(-qmax, qmax).to(torch.int8)
    return q.flatten(), scales


def encode(tensor: torch.Tensor, codec: str, level: int = 3) -> bytes:
    flat = tensor.detach().to("cpu", torch.float32).flatten().contiguous()
    head = _HEAD.pack(_IDS[codec], flat.numel())
    if codec == "fp32":
        body = flat.numpy().tobytes()
    elif codec == "bf16":
        body = flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    elif codec == "int8":
        q, scales = _quantize(flat, 127)
        body = scales.view(torch.int16).numpy().tobytes() + q.numpy().tobytes()
    elif codec == "int4":
        q, scales = _quantize(flat, 7)
        nibbles = (q.to(torch.int16) + 8).to(torch.uint8)  # 1..15
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        body = scales.view(torch.int16).numpy().tobytes() + packed.numpy().tobytes()
    else:
        raise CodecError(f"unknown codec {codec!r}")
    return zstandard.ZstdCompressor(level=level).compress(head + body)


def _expected_body(codec: str, numel: int) -> int:
    blocks = -(-numel // BLOCK)
    return {
        "fp32": 4 * numel,
        "bf16": 2 * numel,
        "int8": 2 * blocks + blocks * BLOCK,
        "int4": 2 * blocks + blocks * BLOCK // 2,
    }[codec]


def max_blob_bytes(codec: str, numel: int) -> int:
    """The most bytes a blob of `numel` values in `codec` can take: zstd's worst case for its
    exact raw size (incompressible input grows by a frame header and ~1/256; ZSTD_COMPRESSBOUND).
    A push that declares more is refused before a byte of it is buffered."""
    raw = _HEAD.size + _expected_body(codec, numel)
    return raw + (raw >> 8) + 64 + (((128 << 10) - raw) >> 11 if raw < (128 << 10) else 0)


def decode(blob: bytes, codec: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 tensor of `shape` a blob of `codec` holds, or CodecError."""
    numel = 1
    for d in shape:
        numel *= d
    limit = _HEAD.size + _expected_body(codec, numel)
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise CodecError(f"not a valid zstd frame: {e}") from e
    if len(raw) != limit:
        raise CodecError(f"decoded {len(raw)} bytes, a {codec} tensor of {numel} values needs {limit}")
    codec_id, count = _HEAD.unpack_from(raw)
    if codec_id != _IDS[codec] or count != numel:
        raise CodecError(f"blob holds codec #{codec_id} with {count} values, expected {codec} with {numel}")
    body = memoryview(raw)[_HEAD.size :]
    if codec == "fp32":
        flat = torch.frombuffer(bytearray(body), dtype=torch.float32)
    elif codec == "bf16":
        flat = torch.frombuffer(bytearray(body), dtype=torch.bfloat16).float()
    else:
        blocks = -(-numel // BLOCK)
        scales = torch.frombuffer(bytearray(body[: 2 * blocks]), dtype=torch.bfloat16).float().unsqueeze(1)
        values = torch.frombuffer(bytearray(body[2 * blocks :]), dtype=torch.uint8)
        if codec == "int8":
            q = values.view(torch.int8).float()
        else:
            q = torch.stack([values & 0x0F, values >> 4], dim=1).flatten().float() - 8.0
        flat = (q.view(blocks, BLOCK) * scales).flatten()[:numel]
    if not torch.isfinite(flat).all():
        raise CodecError("decoded values are not finite")
    return flat.reshape(shape).clone()


def encode_with_feedback(
    tensor: torch.Tensor, codec: str, residual: torch.Tensor | None, level: int = 3
) -> tuple[bytes, torch.Tensor]:
    """Encode tensor + residual; the new residual is what quantization dropped (sent next time)."""
    target = tensor.float() + (residual if residual is not None else 0.0)
    blob = encode(target, codec, level)
    return blob, target - decode(blob, codec, tuple(target.shape))


def encode_step(
    target: torch.Tensor, held: torch.Tensor, codec: str, level: int = 3
) -> tuple[bytes, torch.Tensor]:
    """The way back: encode target − held for a receiver that holds `held`; returns the blob and
    what the receiver holds once it applies it. The next step starts from that, so what
    quantization dropped is sent again and never accumulates (error feedback kept by the sender)."""
    base = held.float()
    blob = encode(target.float() - base, codec, level)
    return blob, base + decode(blob, codec, tuple(target.shape))
