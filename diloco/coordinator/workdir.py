"""What a coordinator's workdir holds, read without starting one: the dataset its run was
partitioned from, where its store is. Light on imports (no torch), so `diloco run` can check its
inputs before it starts a process."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

from diloco.config import RunConfig
from diloco.config_parse import flatten
from diloco.coordinator.ledger import Ledger, ledger_path
from diloco.corpus import dataset_key, resolve_dataset
from diloco.data.fields import check_dataset_field
from diloco.errors import DilocoError


def store_root(config: RunConfig, workdir: str) -> str:
    return config.data.store or str(Path(workdir).resolve())


def dataset_files(config: RunConfig) -> list[str]:
    """The dataset's readable files; a missing or unreadable dataset is a clear error, and so is
    one whose every record lacks data.text_field (a preprocess reads records whole: not checked)."""
    try:
        files = resolve_dataset(config.data.dataset, samples=bool(config.data.preprocess))
    except (OSError, ValueError) as e:
        raise DilocoError(f"cannot read dataset {config.data.dataset!r}: {e}") from e
    if not config.data.preprocess:
        check_dataset_field(files, config.data.text_field)
    return files


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


# How long a coordinator waits for the one before it on its workdir to let go: a holder killed
# with -9 lets go as the kernel closes its files, within milliseconds of its death.
LOCK_WAIT_S = 10.0


def workdir_holder(workdir: str) -> str | None:
    """The pid of the coordinator holding the workdir now, or None: asked without waiting and let
    go at once, before a job touches anything there (its coordinator.json, its run.toml)."""
    path = ledger_path(workdir).parent / "coordinator.lock"
    if not path.exists():
        return None
    with open(path) as held:
        try:
            fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return held.read().strip() or "?"
        fcntl.flock(held, fcntl.LOCK_UN)
    return None


def lock_workdir(workdir: str) -> IO[str]:
    """This process's hold on <workdir>/state/coordinator.lock, for as long as the returned file is
    open: one coordinator per workdir. A second one would share the ledger and the checkpoints, and
    each would undo the other's merges and remove the other's files. The kernel lets go of the lock
    when its holder dies, however it dies, so a restart only waits for the dead one's exit; a
    coordinator still running there is refused, with its pid."""
    path = ledger_path(workdir).parent / "coordinator.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    held = open(path, "a+")  # noqa: SIM115 (held open for the coordinator's life; closed by its stop)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                held.seek(0)
                holder = held.read().strip() or "?"
                held.close()
                raise DilocoError(
                    f"another coordinator (pid {holder}) is running on the workdir {workdir}: one workdir "
                    "holds one coordinator (stop it first, or give this one another --workdir)"
                ) from None
            time.sleep(0.1)
    held.seek(0)
    held.truncate()
    held.write(str(os.getpid()))
    held.flush()
    return held


# The job's, not the run's: a resume names itself anew; each process takes its own cores and device.
NOT_THE_RUNS = frozenset({"name", "train.threads", "train.device"})
# How the coordinator serves, not what the run trains: a restart may change these (more handler
# threads, a longer lease, a higher cap), which a run started with a wrong one needs.
OPERATIONAL = "coordinator."


def resumed_config(given: RunConfig, stored: RunConfig) -> tuple[RunConfig, list[str]]:
    """The settings a restarted run goes on with: those recorded at its first start, but for the
    operational ones (coordinator.*) set at this restart (another value than both the default
    and the record's); and those taken, each as "coordinator.lease_ttl_s = 60.0 (was 30.0)"."""
    now, then, default = flatten(given.to_dict()), flatten(stored.to_dict()), flatten(RunConfig().to_dict())
    taken = {
        key: value
        for key, value in now.items()
        if key.startswith(OPERATIONAL) and value != default.get(key) and value != then.get(key)
    }
    said = [f"{key} = {value!r} (was {then.get(key)!r})" for key, value in taken.items()]
    return (stored.with_overrides(taken) if taken else stored), said


def settings_not_used(given: RunConfig, stored: RunConfig) -> list[str]:
    """The settings set at a restart (not at their default) that differ from those the run
    recorded at its first start, which win (a run does not change its model, data or schedule
    under its checkpoints), each as "train.lr = 0.01 (the run's: 0.001)": said, not dropped in
    silence."""
    now, then, default = flatten(given.to_dict()), flatten(stored.to_dict()), flatten(RunConfig().to_dict())
    differ = []
    for key, value in now.items():
        if key in NOT_THE_RUNS or key not in then or then[key] == value:
            continue
        if value == default.get(key):  # not set now (model.vocab_size 0: "the tokenizer's", too)
            continue
        differ.append(f"{key} = {value!r} (the run's: {then[key]!r})")
    return differ
