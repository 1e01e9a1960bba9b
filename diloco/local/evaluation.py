"""The final global model of a local run: assembled from its checkpoints, saved as one file,
evaluated on the held-out split next to the unigram baseline, and sampled."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco import store
from diloco.compute.device import pick_device
from diloco.config import EvalConfig, RunConfig
from diloco.coordinator.checkpoint import load_model_params
from diloco.coordinator.workdir import store_root
from diloco.data.shard import UNIT_TOKENS, concat_columns, read_shard
from diloco.evaluate import can_sample, evaluate, sample_text, unigram_entropy
from diloco.export import load_parameters, recalibrate_from_run
from diloco.model.contract import running_stats
from diloco.model.factory import build_model
from diloco.model.weights import save_weights
from diloco.tokenizer import Tokenizer

log = logging.getLogger("diloco.run")

SAMPLE_PROMPT = "def "
EVAL_MAX_BATCHES = EvalConfig.final_batches  # the default, as the benchmarks' baselines read
MODEL_FILE = "model.safetensors"


NO_EVAL: dict[str, Any] = {
    "eval_loss": None,
    "eval_metrics": {},
    "baseline_loss": None,
    "eval_tokens": 0,
    "sample": "",
}


def evaluate_final_or_say_why(
    d: dict[str, Any], cfg: RunConfig, workdir: Path, tokenizer: Tokenizer
) -> dict[str, Any]:
    """evaluate_final, or, when the user's model cannot be built or run in this process, the
    run's results without an evaluation and why: the run finished, and its summary must say so
    (a finished workdir takes no second job) and point at `diloco eval`, which can retry."""
    try:
        return evaluate_final(d, cfg, workdir, tokenizer)
    except Exception as e:  # the user's code runs here: anything may come out of it
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        log.warning("no final evaluation (%s); the run's results are kept: diloco eval %s", why, workdir)
        return {**NO_EVAL, "final_eval_error": why}


def evaluate_final(d: dict[str, Any], cfg: RunConfig, workdir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """The final global model: saved as one file, its loss on the held-out split next to the
    unigram baseline, and a sample."""
    versions = d.get("fragment_versions") or []
    shards = [read_shard(s["uri"], s["checksum"]) for s in d.get("eval_shards", [])]
    if not (versions and shards):
        return dict(NO_EVAL)
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    columns = concat_columns(shards)
    model = build_model(cfg.model, vocab, cfg.train.seed)
    params = load_model_params(store.join(store_root(cfg, str(workdir)), "checkpoints"), versions)
    load_parameters(model, params, str(workdir), cfg.model.factory)
    # The trained model in one file: what a later run can start from (model.init_from).
    save_weights(str(workdir / MODEL_FILE), params, {"versions": json.dumps(versions)})
    # On the learners' device: the learners have exited and freed it, and a model sized for a GPU
    # takes minutes to evaluate on the CPU (an 86 M-parameter run: 2 min after 42 s of training).
    device = pick_device(cfg.train.device)
    model.to(device)
    if recalibrate_from_run(model, cfg, workdir, device):  # BatchNorm: the statistics of these weights
        stats = {n: t.detach().cpu() for n, t in running_stats(model).items()}
        save_weights(str(workdir / MODEL_FILE), {**params, **stats}, {"versions": json.dumps(versions)})
    result = evaluate(model, columns, cfg.train.batch_size, device, cfg.eval.final_batches, cfg.model.factory)
    tokens = shards[0].unit == UNIT_TOKENS
    used = columns["input_ids"][: result.rows] if tokens else None
    return {
        "model": str(workdir / MODEL_FILE),
        "eval_loss": result.loss,
        "eval_metrics": result.metrics,
        # Beside a token model's loss, the loss of the best guess that ignores context.
        "baseline_loss": unigram_entropy([used], vocab) if used is not None else None,
        "eval_tokens": int(used.size) if used is not None else result.rows,
        "sample": (
            sample_or_nothing(model, tokenizer, cfg, device)
            if tokens and cfg.eval.sample_tokens and can_sample(model)
            else ""
        ),
    }


def sample_or_nothing(model: nn.Module, tokenizer: Any, cfg: RunConfig, device: torch.device) -> str:
    """The end-of-run sample; a user's model that cannot write one (its logits fail) costs the
    sample, not the run's results: said in one line, and the summary is still written."""
    try:
        return sample_text(
            model,
            tokenizer,
            SAMPLE_PROMPT,
            cfg.eval.sample_tokens,
            device,
            seed=cfg.train.seed,
            window=cfg.model.seq_len,
        )
    except Exception as e:  # the user's code: anything may come out of it
        log.warning("no sample: the model's logits failed (%s: %s)", type(e).__name__, str(e)[:200])
        return ""


def param_count(cfg: RunConfig, vocab: int) -> int | None:
    """The model's parameters, counted on the meta device (nothing allocated); None when the
    factory fails in this process (evaluate_final_or_say_why then says why)."""
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, vocab)
    except Exception:  # the user's code: the run's other figures do not depend on it
        return None
    return sum(math.prod(p.shape) for p in model.parameters())
