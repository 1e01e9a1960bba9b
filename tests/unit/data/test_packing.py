import json

import numpy as np
import pytest

from diloco.data.chunks import partition
from diloco.data.packing import pack_rows
from diloco.data.process import process_chunk
from diloco.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXT = "héllo wörld — naïve café ✓ 日本語\n"


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eot_id, tok.id) == (257, 256, "byte-v1")
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode([*ids, tok.eot_id]) == TEXT


def train_bpe(path, with_eot: bool):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"] if with_eot else []
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator([TEXT * 3, "def f(x):\n    return x + 1\n"] * 10, trainer)
    hf.save(str(path))
    return path


def test_hf_tokenizer_round_trip(tmp_path):
    path = train_bpe(tmp_path / "tok.json", with_eot=True)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.id.startswith("hf-") and len(tok.id) == 3 + 16
    assert tok.eot_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == tok._tok.get_vocab_size()
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode())  # merges happened
    assert tok.decode([*ids, tok.eot_id]) == TEXT
    assert load_tokenizer(str(path)).id == tok.id  # stable identity


def test_hf_tokenizer_without_eot_gets_extra_id(tmp_path):
    path = train_bpe(tmp_path / "tok.json", with_eot=False)
    tok = load_tokenizer(str(path))
    base = tok._tok.get_vocab_size()
    assert (tok.eot_id, tok.vocab_size) == (base, base + 1)
    assert tok.decode([*tok.encode("abc"), tok.eot_id]) == "abc"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_pack_rows_shape_order_and_tail():
    docs = [list(range(0, 5)), list(range(5, 12)), list(range(12, 23))]  # 23 tokens
    rows, dropped = pack_rows(docs, seq_len=4, dtype=np.uint16)
    assert rows.shape == (4, 5) and rows.dtype == np.uint16
    assert dropped == 3
    assert rows.ravel().tolist() == list(range(20))
    empty, dropped = pack_rows([], seq_len=4, dtype=np.uint32)
    assert empty.shape == (0, 5) and dropped == 0
    with pytest.raises(OverflowError):
        pack_rows([[70_000]], seq_len=1, dtype=np.uint16)


def test_process_chunk_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("abc\n")
    (tmp_path / "b.jsonl").write_bytes(
        b'{"text": "xy"}\n'
        b"not json\n"
        b'{"other": "zz"}\n'
        b"\n"
        b"[1, 2]\n"
        b'{"text": 5}\n'
        b'{"text": ""}\n'
        b'{"text": "\\u00e9"}\n'
        b'{"text": "\xff\xfe"}\n'
    )
    chunks = partition([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], 1 << 20, 0.0)
    assert len(chunks) == 1
    tok = ByteTokenizer()
    out = process_chunk(chunks[0], tok, seq_len=3, text_field="text")
    eot = tok.eot_id
    stream = [*b"abc\n", eot, *b"xy", eot, *"é".encode(), eot]
    assert out.tokens_in == len(stream) == 11
    assert out.rows.shape == (2, 4) and out.dropped_tokens == 3
    assert out.rows.ravel().tolist() == stream[:8]
    assert out.bytes_in == chunks[0].nbytes
    assert out.stats.as_dict() == {
        "records": 3,
        "skipped_undecodable": 1,
        "skipped_missing_field": 2,
        "skipped_not_json": 2,
        "skipped_ragged_row": 0,
        "skipped_empty": 1,
        "skipped_oversized": 0,
        "replaced_undecodable": 0,
        "truncated_compressed": 0,
        "empty_files": 0,
        "unreadable_files": 0,
    }


def test_process_chunk_split_text_file_marks_only_the_end(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"line one\n" * 20 + b"bad \xff byte\n")
    chunks = partition([str(path)], chunk_bytes=50, eval_fraction=0.0)
    assert len(chunks) > 2
    tok = ByteTokenizer()
    outs = [process_chunk(c, tok, seq_len=1, text_field="text") for c in chunks]
    eots = [int((o.rows == tok.eot_id).sum()) for o in outs]
    assert eots[:-1] == [0] * (len(outs) - 1) and eots[-1] == 1
    assert outs[-1].stats.replaced_undecodable == 1
    assert sum(o.stats.records for o in outs) == len(chunks)
