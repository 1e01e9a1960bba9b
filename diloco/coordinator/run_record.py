"""The run's record in its ledger: written at the first start (the dataset partitioned into chunks,
the settings and the tokenizer recorded), taken up again at each restart."""

from __future__ import annotations

import logging

from diloco import store
from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger, ledger_path
from diloco.coordinator.workdir import check_same_dataset, dataset_files, resumed_config, settings_not_used
from diloco.data.chunks import mixed_order, partition_dataset
from diloco.data.samples import image_classes
from diloco.errors import DilocoError
from diloco.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("diloco.coordinator")


def open_ledger(config: RunConfig, workdir: str) -> tuple[Ledger, RunConfig]:
    """The ledger under <workdir>/state; on first start, partition the dataset into it.

    On a restart the configuration recorded at first start wins: a run does not change its model
    or data under a checkpoint. Another dataset than the recorded one is refused.
    """
    path = ledger_path(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(str(path))
    if ledger.initialized:
        try:
            check_same_dataset(ledger.get_meta("dataset"), config, workdir)
        except DilocoError:
            ledger.close()
            raise
        stored, taken = resumed_config(config, RunConfig.from_json(ledger.get_meta("config") or "{}"))
        log.info("resuming run %s from %s", stored.name or "(unnamed)", path.parent)
        if taken:
            try:
                stored.validate()  # with the record's other settings (a heartbeat above its lease)
            except Exception:
                ledger.close()
                raise
            log.info("at this restart: %s", "; ".join(taken))
            ledger.set_meta(config=stored.to_json())  # the next restart starts from them
        if differ := settings_not_used(config, stored):
            log.warning(
                "the run keeps the settings it started with; not used: %s (a new --workdir starts a run "
                "with them)",
                "; ".join(differ),
            )
        return ledger, stored
    if config.model.init_from and not store.exists(config.model.init_from):
        raise DilocoError(f"model.init_from: not found: {config.model.init_from}")
    tokenizer = run_tokenizer(config)
    if config.model.vocab_size == 0:
        config = config.with_overrides({"model.vocab_size": tokenizer.vocab_size})
    elif config.model.vocab_size < tokenizer.vocab_size:
        raise DilocoError(
            f"model.vocab_size {config.model.vocab_size} is below the tokenizer's {tokenizer.vocab_size}"
        )
    files = dataset_files(config)
    if config.data.preprocess and not config.data.classes and (classes := image_classes(files)):
        config = config.with_overrides({"data.classes": classes})  # recorded: labels never shift
    if config.data.preprocess and config.data.shuffle:
        files = mixed_order(files, config.train.seed)
    try:
        parts = partition_dataset(
            files,
            config.data.chunk_bytes,
            config.data.eval_fraction,
            config.data.text_field,
            config.data.epochs,
        )
    except (OSError, ValueError) as e:
        raise DilocoError(f"cannot read dataset {config.data.dataset!r}: {e}") from e
    chunks = parts.chunks
    if not chunks:
        raise DilocoError(f"dataset {config.data.dataset!r} has no data")
    # Files left out at partition (empty, unreadable) count with the records the workers skip.
    skipped = {f"records.{k}": float(v) for k, v in parts.stats.as_dict().items() if v}
    ledger.initialize(
        chunks,
        counters=skipped,
        shuffle_seed=config.train.seed if config.data.shuffle else None,
        dataset=config.data.dataset,
        config=config.to_json(),
        tokenizer_id=tokenizer.id,
        tokenizer_hash=tokenizer.fingerprint,
    )
    log.info(
        "partitioned %d files into %d chunks (%d eval)%s",
        len(files),
        len(chunks),
        sum(c.split == "eval" for c in chunks),
        "".join(f", {v} {k.replace('_', ' ')}" for k, v in parts.stats.as_dict().items() if v),
    )
    return ledger, config


def run_tokenizer(config: RunConfig) -> Tokenizer:
    try:
        return load_tokenizer(config.data.tokenizer)
    except ValueError as e:
        raise DilocoError(f"cannot load tokenizer {config.data.tokenizer!r}: {e}") from e


def tokenizer_hash(config: RunConfig, ledger: Ledger) -> str:
    """The tokenizer's fingerprint now, which every worker must match at join.

    Loaded at every start; a tokenizer that changed since the run began is refused (its shards
    would mix two vocabularies).
    """
    fingerprint = run_tokenizer(config).fingerprint
    recorded = ledger.get_meta("tokenizer_hash")
    if recorded is None:
        ledger.set_meta(tokenizer_hash=fingerprint)  # a ledger from before the check
    elif recorded != fingerprint:
        raise DilocoError(
            f"tokenizer {config.data.tokenizer!r} changed since this run started ({recorded[:16]} then, "
            f"{fingerprint[:16]} now): restore it, or start a new run in a fresh workdir"
        )
    return fingerprint
