"""What a safetensors export's config.json says: a token model's tokenizer and shape; a
preprocess's model its preprocess and class names (what its labels mean), without token fields."""

from __future__ import annotations

from diloco.config import RunConfig
from diloco.export import export_config


def test_a_token_model_names_its_tokenizer_and_shape() -> None:
    said = export_config(RunConfig().with_overrides({"model.seq_len": 64}), [3, 4])
    assert said["model"]["seq_len"] == 64 and "vocab_size" in said["model"]
    assert said["tokenizer"] == "byte" and said["versions"] == [3, 4] and "data" not in said


def test_a_preprocess_model_names_its_classes_and_no_token_fields() -> None:
    cfg = RunConfig().with_overrides({
        "model.factory": "examples.digits.model:cnn", "data.preprocess": "examples.digits.prep:pixels",
        "data.classes": ["cat", "dog"],
    })  # fmt: skip
    said = export_config(cfg, [7])
    assert "seq_len" not in said["model"] and "vocab_size" not in said["model"]
    assert said["model"]["factory"] == "examples.digits.model:cnn" and "tokenizer" not in said
    assert said["data"] == {"preprocess": "examples.digits.prep:pixels", "classes": ["cat", "dog"]}
