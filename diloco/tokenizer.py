"""Tokenizers: byte-level (the default, needs nothing) or any Hugging Face tokenizer.json."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from diloco import store
from diloco.errors import DilocoError

# End-of-text tokens looked up, in order, in a HF vocabulary.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


@runtime_checkable
class Tokenizer(Protocol):
    id: str  # stable identity, recorded in every shard so mixed tokenizers are caught
    # What every worker checks at join: "byte-v1", or the sha256 (hex) of the tokenizer.json bytes.
    fingerprint: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus end-of-text 256."""

    id = "byte-v1"
    fingerprint = "byte-v1"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        # Lone surrogates cannot be UTF-8 encoded; replace rather than fail on odd input.
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer from tokenizer.json text.

    When the vocabulary has none of EOT_CANDIDATES, end-of-text gets the id just past it
    (eot_id = base vocab size, vocab_size = base + 1): the model learns that row of the embedding,
    and decode drops it, so the tokenizer file itself never has to change.
    """

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer as _HF  # imported here: only HF users pay for it

        self._tok = _HF.from_str(json_text)
        # The file's bytes are its UTF-8 text (decoding and encoding back is exact).
        self.fingerprint = hashlib.sha256(json_text.encode("utf-8")).hexdigest()
        self.id = "hf-" + self.fingerprint[:16]
        base = self._tok.get_vocab_size(with_added_tokens=True)
        found = [self._tok.token_to_id(t) for t in EOT_CANDIDATES]
        eot = next((i for i in found if i is not None), None)
        if eot is None:
            self.eot_id, self.vocab_size = base, base + 1
        else:
            self.eot_id, self.vocab_size = eot, base

    @classmethod
    def from_uri(cls, uri: str) -> HFTokenizer:
        return cls(store.read_bytes(uri).decode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i != self.eot_id], skip_special_tokens=False)


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a Hugging Face tokenizer.json: the same ids (byte b is id b, end-of-text
    256), for tools that load only that format (an exported model's directory).

    GPT-2's byte-level alphabet names each byte by a printable character; a BPE over exactly those
    256 characters with no merges then gives one id per byte, in byte order.
    """
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 512))
    char_of = {b: chr(b if b in printable else next(shifted)) for b in range(256)}
    tok = _HF(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_CANDIDATES[0]])  # id 256, after the 256 bytes
    return tok.to_str()


def load_tokenizer(spec: str) -> Tokenizer:
    """ "byte", or the path/URI of a HF tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    try:
        return HFTokenizer.from_uri(spec)
    except Exception as e:  # missing file, not UTF-8, not a tokenizer.json: all one answer
        raise ValueError(f"cannot load tokenizer {spec!r} (expected 'byte' or a tokenizer.json): {e}") from e


class TokenizerMismatch(DilocoError):
    """This worker's tokenizer is not the one the coordinator started the run with."""


def check_fingerprint(tokenizer: Tokenizer, spec: str, expected: str) -> None:
    """Refuse to work with a tokenizer other than the coordinator's (e.g. the file changed since)."""
    if expected and tokenizer.fingerprint != expected:
        raise TokenizerMismatch(
            f"tokenizer {spec!r} here is {tokenizer.fingerprint[:16]}, but the coordinator started the run "
            f"with {expected[:16]}: the file changed or differs on this machine; give every role the same "
            "tokenizer.json (or restart the run)"
        )


def load_checked_tokenizer(spec: str, expected: str) -> Tokenizer:
    """A worker's tokenizer at join: loaded from `spec` and checked against the coordinator's
    fingerprint. DilocoError (a clear line, non-zero exit) when it cannot be loaded or differs."""
    try:
        tokenizer = load_tokenizer(spec)
    except ValueError as e:
        raise DilocoError(str(e)) from e
    check_fingerprint(tokenizer, spec, expected)
    return tokenizer
