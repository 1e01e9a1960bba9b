"""A run's global model, out of its checkpoints and into a form other tools load.

    diloco export RUN --format hf --out DIR           AutoModelForCausalLM.from_pretrained(DIR)
    diloco export RUN --format safetensors --out DIR  model.safetensors + config.json (any model)
    diloco export --coordinator HOST:PORT --out DIR   a live run's latest published model

RUN is the run's directory (the coordinator's workdir). The model is built by the run's factory,
so the machine that exports needs the model's code installed, like a learner. Weights that are
not that model's (a run whose learners brought their own model, diloco.connect, while its
coordinator named another) are refused in one line: `--model` names the factory that fits them.
A model with BatchNorm is written with its running statistics recomputed for its weights on the
run's first train rows (eval.recalibrate_batches; diloco.model.recalibrate).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator.checkpoint import load_model_params
from diloco.coordinator.ledger.evals import TRAIN_HEAD_SQL, train_head
from diloco.coordinator.report import read_only, stored_run
from diloco.coordinator.workdir import store_root
from diloco.errors import DilocoError
from diloco.model.contract import layout_difference, synced_tensors
from diloco.model.factory import build_model
from diloco.model.recalibrate import first_rows, recalibrate
from diloco.model.weights import save_weights

log = logging.getLogger("diloco.export")

FORMATS = ("hf", "safetensors")


def with_factory(cfg: RunConfig, factory: str | None) -> RunConfig:
    """The run's config with the model built by `factory` instead (None: the run's own). The
    run's model.kwargs were written for its factory, so another one is called without them."""
    if not factory or factory == cfg.model.factory:
        return cfg
    return cfg.with_overrides({"model.factory": factory, "model.kwargs": {}}).validate()


def load_parameters(
    model: nn.Module, params: Mapping[str, torch.Tensor], source: str, factory: str
) -> nn.Module:
    """Copy `params` into `model` (cast to its dtypes): its parameters and running statistics
    (contract.synced_tensors). Weights of another model are refused in one line naming the tensors
    that differ: copying them would fail on the first missing name."""
    mine = synced_tensors(model)
    diff = layout_difference(
        {n: (tuple(p.shape), "") for n, p in mine.items()},
        {n: (tuple(t.shape), "") for n, t in params.items()},
    )
    if diff:
        raise DilocoError(
            f"{source} holds the weights of another model than model.factory {factory} builds ({diff}): "
            "give the factory of the model that made them with --model package.module:function"
        )
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(params[name])
    return model


def global_model(workdir: str | Path, factory: str | None = None) -> tuple[RunConfig, nn.Module, list[int]]:
    """The run's config, its model (or `factory`'s) holding the latest published parameters, and
    their versions."""
    try:
        config_json, versions = stored_run(workdir)
    except FileNotFoundError as e:
        raise DilocoError(str(e)) from e
    cfg = with_factory(RunConfig.from_json(config_json), factory)
    if not versions or min(versions) < 0:
        raise DilocoError(f"{workdir}: the run has no published parameters yet")
    params = load_model_params(store.join(store_root(cfg, str(workdir)), "checkpoints"), versions)
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_parameters(model, params, str(workdir), cfg.model.factory)
    recalibrate_from_run(model, cfg, workdir)
    return cfg, model.eval(), versions


def recalibrate_from_run(
    model: nn.Module, cfg: RunConfig, workdir: str | Path, device: torch.device | str = "cpu"
) -> int:
    """recalibrate `model`'s running statistics on the run's first train rows, as its ledger lists
    them; the rows forwarded (0: no running statistics, eval.recalibrate_batches 0, or shards that
    cannot be read, said in one line: the merged statistics are kept)."""
    wanted = cfg.eval.recalibrate_batches * cfg.train.batch_size

    def rows() -> dict[str, np.ndarray] | None:
        try:
            with read_only(workdir) as db:
                shards = train_head(db.execute(TRAIN_HEAD_SQL, (wanted,)), wanted)
            return first_rows(shards, wanted)
        except (OSError, ValueError, sqlite3.Error) as e:  # a run moved without its shards
            log.warning("BatchNorm statistics not recomputed, the merged ones kept: %s", e)
            return None

    return recalibrate(
        model, rows=rows, batch_size=cfg.train.batch_size, batches=cfg.eval.recalibrate_batches, device=device
    )


def export_run(workdir: str | Path, out: str | Path, fmt: str, factory: str | None = None) -> list[Path]:
    """Write the run's global model (built by `factory`, when given) to `out` in format `fmt`;
    the files written."""
    if fmt not in FORMATS:
        raise DilocoError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return write_model(*global_model(workdir, factory), out, fmt)


def export_config(cfg: RunConfig, versions: list[int]) -> dict:
    """What a safetensors export says of its model: how to build it and, for a preprocess's model,
    what its inputs were made by and what its labels name (the token fields mean nothing there)."""
    model = cfg.to_dict()["model"]
    if not cfg.data.preprocess:
        return {"model": model, "tokenizer": cfg.data.tokenizer, "versions": versions}
    model = {k: v for k, v in model.items() if k not in ("vocab_size", "seq_len")}
    data = {"preprocess": cfg.data.preprocess, "classes": list(cfg.data.classes)}
    return {"model": model, "data": data, "versions": versions}


def write_model(
    cfg: RunConfig, model: nn.Module, versions: list[int], out: str | Path, fmt: str
) -> list[Path]:
    """Write `model` (the run's, at `versions`) to `out` in format `fmt`; the files written."""
    if fmt not in FORMATS:
        raise DilocoError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    out = Path(out)
    save = getattr(model, "save_pretrained", None)
    if fmt == "hf" and not callable(save):  # before the folder is made: nothing left behind
        raise DilocoError(
            f"model.factory {cfg.model.factory} has no Hugging Face form (no save_pretrained): "
            "use --format safetensors"
        )
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        params = {n: p.detach() for n, p in synced_tensors(model).items()}  # the statistics too
        save_weights(str(out / "model.safetensors"), params, {"versions": json.dumps(versions)})
        (out / "config.json").write_text(json.dumps(export_config(cfg, versions), indent=2))
    else:
        from diloco.model.hf import mark_end_of_text, save_tokenizer  # transformers: only for this format
        from diloco.tokenizer import load_tokenizer

        mark_end_of_text(model, load_tokenizer(cfg.data.tokenizer).eot_id)
        save(str(out))  # type: ignore[misc]

        save_tokenizer(cfg.data.tokenizer, str(out))
    return sorted(p for p in out.iterdir() if p.is_file())
