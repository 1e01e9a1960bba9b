"""Using a run's model without writing code: evaluate it, sample from it.

    diloco eval RUN [--dataset URI]            loss (and metrics) on the held-out split, or on your data
    diloco eval --coordinator HOST:PORT        the live run's latest published model
    diloco eval --workdir W                    the same, of a live `diloco run` job (its address and
                                               an evaluator's certificate from its CA)
    diloco generate RUN --prompt TEXT          a token model continues the prompt

RUN is a run's directory (the coordinator's workdir), or a weights file inside one (e.g. its
`model.safetensors`). The model is built by the run's factory (or the one --model names), so the
machine needs the model's code installed, like a learner. Data given with --dataset goes through
the run's own data path (its tokenizer and packing, or its preprocess), into shards in a
temporary directory.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from diloco.client import CoordinatorClient
from diloco.compute.device import pick_device
from diloco.config import RunConfig
from diloco.coordinator.report import read_only, stored_run
from diloco.data.chunks import partition_dataset
from diloco.data.makers import shard_maker
from diloco.data.shard import UNIT_TOKENS, concat_columns, read_shard
from diloco.errors import DilocoError
from diloco.evaluate import EvalResult, can_sample, evaluate, sample_text, unigram_entropy
from diloco.export import global_model, load_parameters, recalibrate_from_run, with_factory
from diloco.model.factory import build_model
from diloco.model.recalibrate import first_rows, recalibrate
from diloco.model.weights import load_weights
from diloco.security.transport import Security
from diloco.tokenizer import load_tokenizer
from diloco.v1 import coordinator_pb2 as pb


@dataclass
class LoadedModel:
    cfg: RunConfig
    model: torch.nn.Module
    source: str  # where its parameters came from, for the output
    eval_shards: list[dict[str, Any]]  # the run's held-out split: {"uri", "checksum"}
    versions: list[int]  # the published versions it holds ([] for a weights file)
    eval_chunks: int = 0  # chunks in the held-out split, made into shards or not yet


def load_model(
    run: str | Path | None,
    coordinator: str | None,
    factory: str | None = None,
    workdir: Path | None = None,
) -> LoadedModel:
    """The run's model with its parameters; `factory`: build this model instead of the run's.
    `workdir`: a live `diloco run` job's, whose coordinator is asked (as `coordinator` would be)
    with an evaluator's certificate from the job's CA."""
    if sum(x is not None for x in (run, coordinator, workdir)) != 1:
        raise DilocoError(
            "give one of: a run directory (or a weights file in one), --coordinator HOST:PORT, "
            "or --workdir of a live `diloco run`"
        )
    if workdir is not None:
        address, security = job_evaluator(workdir)
        return _from_coordinator(address, factory, security)
    if coordinator:
        return _from_coordinator(coordinator, factory)
    return _from_run(Path(run), factory)  # type: ignore[arg-type]


# The certificate `diloco eval --workdir` pulls a job's model with: an evaluator's of its own
# (tls/eval.crt), not the job's evaluator's: joining under its name would take that one's place.
EVAL_TOOL = "eval"


def job_evaluator(
    workdir: Path, certificates: Callable[[Path, dict[str, str]], dict[str, Any]] | None = None
) -> tuple[str, Security | None]:
    """A live `diloco run` job's coordinator address (its coordinator.json) and the identity to pull
    its model with: identity flags given, those; a job under mutual TLS, an evaluator's certificate
    from its CA (made once); a --no-tls job, none."""
    from diloco.local.tls import job_address, run_certificates

    address, job_security = job_address(workdir)
    if Security.from_env().mode != "none":  # an identity given: it is used
        return address, None
    if job_security.tls is None:
        return address, job_security
    made = (certificates or run_certificates)(workdir, {EVAL_TOOL: "evaluator"})
    return address, Security(tls=made[EVAL_TOOL])


def refused_join_line(address: str, details: str) -> str:
    """A coordinator that refused `diloco eval`'s join (PERMISSION_DENIED): what identity it takes."""
    return (
        f"the coordinator at {address} refused to let this evaluator join: {details} (eval --coordinator "
        "takes an evaluator's certificate: diloco certs issue --role evaluator; for a `diloco run` "
        "job, give --workdir instead)"
    )


def _from_run(path: Path, factory: str | None) -> LoadedModel:
    if path.is_file():  # weights of the run's model, e.g. <run>/model.safetensors
        workdir = path.parent
        cfg = with_factory(RunConfig.from_json(_stored_config(workdir)), factory)
        model = build_model(cfg.model, seed=cfg.train.seed)
        load_parameters(model, load_weights(str(path)), str(path), cfg.model.factory)
        recalibrate_from_run(model, cfg, workdir)
        source, versions = str(path), []
    else:
        workdir = path
        cfg, model, versions = global_model(path, factory)
        source = f"{path} at versions {versions}"
    shards, chunks = held_out_split(workdir)
    return LoadedModel(cfg, model.eval(), source, shards, versions, chunks)


def held_out_split(workdir: Path) -> tuple[list[dict[str, Any]], int]:
    """A run's held-out split as its ledger records it: its shards ({"uri", "checksum"} in chunk
    order), and how many chunks it has (their shards may not be made yet)."""
    with read_only(workdir) as db:
        shards = db.execute(
            "SELECT uri, checksum FROM shards WHERE split = 'eval' ORDER BY chunk_id"
        ).fetchall()
        chunks = int(db.execute("SELECT COUNT(*) FROM chunks WHERE split = 'eval'").fetchone()[0])
    return [{"uri": u, "checksum": c} for u, c in shards], chunks


def _stored_config(workdir: Path) -> str:
    try:
        return stored_run(workdir)[0]
    except FileNotFoundError as e:
        raise DilocoError(f"{e}: a weights file is read beside its run's ledger") from e


def _from_coordinator(address: str, factory: str | None, security: Security | None = None) -> LoadedModel:
    """The live run's latest published model, pulled as an evaluator would."""
    client = CoordinatorClient(address, pb.ROLE_EVALUATOR, retry_deadline_s=10, security=security)
    try:
        try:
            reply = client.join(10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            raise DilocoError(refused_join_line(address, e.details() or "")) from None
        if client.config is None:  # (a join always brings it; not an assert: -O drops those)
            raise DilocoError(f"{address}: the coordinator sent no run configuration")
        cfg = with_factory(client.config, factory)
        if not reply.fragment_versions:
            raise DilocoError(f"{address}: the run has no parameters yet")
        model = build_model(cfg.model, seed=cfg.train.seed)
        pulled = {n: t for _, ts in client.pull(list(range(reply.num_fragments))) for n, t in ts.items()}
        load_parameters(model, pulled, address, cfg.model.factory)
        status = client.status()
        wanted = cfg.eval.recalibrate_batches * cfg.train.batch_size
        train = (status.get("recalibration_split") or {}).get("shards", [])
        recalibrate(
            model, rows=lambda: first_rows(train, wanted), batch_size=cfg.train.batch_size,
            batches=cfg.eval.recalibrate_batches,
        )  # fmt: skip
        held_out = status.get("eval_split", {})
        split, eval_chunks = held_out.get("shards", []), int(held_out.get("chunks", 0))
        versions = list(reply.fragment_versions)
    finally:
        client.leave("done")
        client.close()
    return LoadedModel(cfg, model.eval(), f"{address} at versions {versions}", split, versions, eval_chunks)


def dataset_columns(cfg: RunConfig, dataset: str) -> tuple[dict[str, np.ndarray], str]:
    """Your data as the run's shards hold it: partitioned, made by the run's shard maker (its
    tokenizer and packing, or its preprocess) into a temporary directory, and read back."""
    d = cfg.with_overrides({"data.dataset": dataset})
    from diloco.coordinator.workdir import dataset_files

    files = dataset_files(d)
    chunks = partition_dataset(files, d.data.chunk_bytes, 0.0, d.data.text_field).chunks
    if not chunks:
        raise DilocoError(f"dataset {dataset!r} has no data")
    maker = shard_maker(d, load_tokenizer(d.data.tokenizer))
    with tempfile.TemporaryDirectory(prefix="diloco-eval-") as tmp:
        try:
            shards = [read_shard(maker.make(c, str(Path(tmp) / f"{c.index}.shard")).info.uri) for c in chunks]
        except DilocoError:
            raise
        except Exception as e:  # the user's preprocess, on data it was not written for
            made_by = f"data.preprocess {d.data.preprocess}" if d.data.preprocess else "the run's tokenizer"
            raise DilocoError(f"{made_by} failed on {dataset!r}: {type(e).__name__}: {e}") from e
    columns, unit = concat_columns(shards), shards[0].unit
    if not min(len(c) for c in columns.values()):
        raise DilocoError(no_rows_line(d, dataset, unit))
    return columns, unit


def no_rows_line(cfg: RunConfig, dataset: str, unit: str) -> str:
    """Why --dataset gives nothing to evaluate on: a token run packs rows of model.seq_len + 1
    tokens and drops the shorter rest; a preprocess run kept no sample."""
    if unit == UNIT_TOKENS:
        return (
            f"--dataset {dataset} made no rows of model.seq_len + 1 = {cfg.model.seq_len + 1} tokens: "
            "give more text"
        )
    by = f" (data.preprocess {cfg.data.preprocess} kept none)" if cfg.data.preprocess else ""
    return f"--dataset {dataset} made no samples{by}: give more data"


def held_out_columns(loaded: LoadedModel) -> tuple[dict[str, np.ndarray], str]:
    if not loaded.eval_shards and loaded.eval_chunks:
        raise DilocoError(
            f"the run's held-out split ({loaded.eval_chunks} chunks) has no shards yet: data workers make "
            "them as the run goes (or give --dataset)"
        )
    if not loaded.eval_shards:
        raise DilocoError("the run has no held-out split: give --dataset")
    shards = [read_shard(s["uri"], s["checksum"]) for s in loaded.eval_shards]
    return concat_columns(shards), shards[0].unit


def evaluate_loaded(
    loaded: LoadedModel, dataset: str | None, max_batches: int | None, device: str = "cpu"
) -> dict[str, Any]:
    columns, unit = dataset_columns(loaded.cfg, dataset) if dataset else held_out_columns(loaded)
    on = pick_device(device)
    result: EvalResult = evaluate(
        loaded.model.to(on), columns, loaded.cfg.train.batch_size, on, max_batches, loaded.cfg.model.factory
    )
    out: dict[str, Any] = {"model": loaded.source, "data": dataset or "held-out split", "rows": result.rows,
                           "loss": result.loss, "metrics": result.metrics}  # fmt: skip
    if unit == UNIT_TOKENS:
        out["loss_unit"] = "nats/token"  # as the run's tables say it
        vocab = loaded.cfg.model.vocab_size
        out["baseline_loss"] = unigram_entropy([columns["input_ids"][: result.rows]], vocab)
    return out


def generate_text(
    loaded: LoadedModel, prompt: str, tokens: int, temperature: float, seed: int, device: str = "cpu"
) -> str:
    if not can_sample(loaded.model):
        raise DilocoError(
            f"the run's model ({loaded.cfg.model.factory}) has no logits(input_ids) to sample from"
        )
    tokenizer = load_tokenizer(loaded.cfg.data.tokenizer)
    on = pick_device(device)
    return sample_text(
        loaded.model.to(on), tokenizer, prompt, tokens, on, seed=seed, temperature=temperature,
        window=loaded.cfg.model.seq_len,
    )  # fmt: skip
