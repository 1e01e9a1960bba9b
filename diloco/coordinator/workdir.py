"""What a coordinator's workdir holds, read without starting one: the dataset its run was
partitioned from, where its store is. Light on imports (no torch), so `diloco run` can check its
inputs before it starts a process."""

from __future__ import annotations

from pathlib import Path

from diloco.config import RunConfig
from diloco.coordinator.ledger import Ledger, ledger_path
from diloco.corpus import dataset_key, resolve_dataset
from diloco.errors import DilocoError


def store_root(config: RunConfig, workdir: str) -> str:
    return config.data.store or str(Path(workdir).resolve())


def dataset_files(config: RunConfig) -> list[str]:
    """The dataset's readable files; a missing or unreadable dataset is a clear error."""
    try:
        return resolve_dataset(config.data.dataset, samples=bool(config.data.preprocess))
    except (OSError, ValueError) as e:
        raise DilocoError(f"cannot read dataset {config.data.dataset!r}: {e}") from e


def recorded_dataset(workdir: str) -> str | None:
    """The dataset a workdir's run was partitioned from; None when no run was started there."""
    path = ledger_path(workdir)
    if not path.exists():
        return None
    ledger = Ledger(str(path))
    try:
        return ledger.get_meta("dataset")
    finally:
        ledger.close()


def check_same_dataset(recorded: str | None, config: RunConfig, workdir: str) -> None:
    """A workdir holds one run: resuming it on other data would silently train on the old data."""
    given = config.data.dataset
    if recorded is not None and dataset_key(recorded) != dataset_key(given):
        raise DilocoError(
            f"workdir {workdir} holds a run on dataset {recorded!r}, not {given!r}: use a new --workdir "
            f"for another dataset (or --dataset {recorded} to resume that run)"
        )
