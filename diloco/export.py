"""A run's global model, out of its checkpoints and into a form other tools load.

    diloco export RUN --format hf --out DIR           AutoModelForCausalLM.from_pretrained(DIR)
    diloco export RUN --format safetensors --out DIR  model.safetensors + config.json (any model)
    diloco export --coordinator HOST:PORT --out DIR   a live run's latest published model

RUN is the run's directory (the coordinator's workdir). The model is built by the run's factory,
so the machine that exports needs the model's code installed, like a learner.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator.checkpoint import load_model_params
from diloco.coordinator.report import stored_run
from diloco.coordinator.workdir import store_root
from diloco.errors import DilocoError
from diloco.model.factory import build_model
from diloco.model.weights import save_weights

FORMATS = ("hf", "safetensors")


def global_model(workdir: str | Path) -> tuple[RunConfig, nn.Module, list[int]]:
    """The run's config, its model holding the latest published parameters, and their versions."""
    try:
        config_json, versions = stored_run(workdir)
    except FileNotFoundError as e:
        raise DilocoError(str(e)) from e
    cfg = RunConfig.from_json(config_json)
    if not versions or min(versions) < 0:
        raise DilocoError(f"{workdir}: the run has no published parameters yet")
    params = load_model_params(store.join(store_root(cfg, str(workdir)), "checkpoints"), versions)
    model = build_model(cfg.model, seed=cfg.train.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return cfg, model.eval(), versions


def export_run(workdir: str | Path, out: str | Path, fmt: str) -> list[Path]:
    """Write the run's global model to `out` in format `fmt`; the files written."""
    if fmt not in FORMATS:
        raise DilocoError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return write_model(*global_model(workdir), out, fmt)


def write_model(
    cfg: RunConfig, model: nn.Module, versions: list[int], out: str | Path, fmt: str
) -> list[Path]:
    """Write `model` (the run's, at `versions`) to `out` in format `fmt`; the files written."""
    if fmt not in FORMATS:
        raise DilocoError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        params = {n: p.detach() for n, p in model.named_parameters()}
        save_weights(str(out / "model.safetensors"), params, {"versions": json.dumps(versions)})
        (out / "config.json").write_text(
            json.dumps({"model": cfg.to_dict()["model"], "versions": versions}, indent=2)
        )
    else:
        save = getattr(model, "save_pretrained", None)
        if not callable(save):
            raise DilocoError(
                f"model.factory {cfg.model.factory} has no Hugging Face form (no save_pretrained): "
                "use --format safetensors"
            )
        save(str(out))
        from diloco.model.hf import save_tokenizer  # transformers: only for this format

        save_tokenizer(cfg.data.tokenizer, str(out))
    return sorted(p for p in out.iterdir() if p.is_file())
