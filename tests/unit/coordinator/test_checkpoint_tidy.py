"""A restarted coordinator clears the checkpoint files its dead predecessor left behind.

Each file is a whole fragment with its momentum (twice the fragment's fp32 size), and the publisher
only removes versions it published itself: without the tidy, every coordinator restart of a long
run left one file per fragment on the store for good, and a kill during a save a temporary one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from diloco.coordinator import checkpoint
from diloco.coordinator.checkpoint import files_to_remove
from diloco.coordinator.server import start_coordinator
from tests.support import delta_header, tiny_coordinator, wait_for


def test_a_resume_keeps_its_version_and_the_newest_older_one() -> None:
    found = [(1, False), (2, False), (3, False)]
    assert files_to_remove(found, current=3) == [(1, False)]


def test_files_written_after_the_last_commit_are_removed() -> None:
    # v4 was saved, then the coordinator died before the ledger recorded it: the resume is at 3,
    # and the merge that made v4 is made again (its pushes were dropped by the restart).
    found = [(2, False), (3, False), (4, False)]
    assert files_to_remove(found, current=3) == [(4, False)]


def test_temporary_files_a_kill_cut_off_are_removed_whatever_their_version() -> None:
    found = [(2, True), (3, False), (3, True), (4, True)]
    assert sorted(files_to_remove(found, current=3)) == [(2, True), (3, True), (4, True)]


def test_nothing_to_remove_at_the_first_version() -> None:
    assert files_to_remove([(0, False)], current=0) == []


@pytest.mark.timeout(120)
def test_a_restarted_coordinator_removes_what_a_dead_one_left(tiny_corpus: Path, tmp_path: Path) -> None:
    with tiny_coordinator(tiny_corpus, tmp_path, {}) as (running, learner, init):
        frag = running.service.fragments[0]
        for version in range(2):
            header = delta_header(learner, "fp32", f"push-{version}")
            header.version = version
            reply = learner.push(header, {n: torch.randn_like(t) * 1e-3 for n, t in init.items()})
            assert reply.accepted, reply.reason
            wait_for(
                lambda v=version: frag.published_version > v, 20, f"version {version + 1} published", 0.02
            )
        config, root = running.service.config, running.service.checkpoint_root
    folder = Path(root)
    current = folder / "fragment-0-v00000002.safetensors"
    # What a coordinator killed mid-run leaves: a file older than the fallback (its own fallback,
    # which no one removes after a restart), a version saved but never committed, a cut-off save.
    for name in ("fragment-0-v00000000.safetensors", "fragment-0-v00000003.safetensors",
                 "fragment-0-v00000003.safetensors.tmp-0badc0de"):  # fmt: skip
        shutil.copy(current, folder / name)
    resumed = start_coordinator(config, str(tmp_path))
    try:
        frag = resumed.service.fragments[0]
        assert frag.version == 2
        assert sorted(p.name for p in folder.iterdir()) == [
            "fragment-0-v00000001.safetensors",
            "fragment-0-v00000002.safetensors",
        ]
        assert frag.files == [1, 2]
        params, _ = checkpoint.load_fragment(root, 0, 2)
        assert all(torch.equal(params[n], t) for n, t in frag.params.items())
    finally:
        resumed.stop()


def test_keep_versions_keeps_that_many_before_a_resume_and_zero_keeps_every_one() -> None:
    found = [(v, False) for v in range(1, 6)] + [(6, False), (6, True)]
    assert sorted(files_to_remove(found, current=5, keep=3)) == [
        (1, False),
        (2, False),
        (6, False),
        (6, True),
    ]
    # Every committed version stays; what was never committed (or cut off) still goes.
    assert sorted(files_to_remove(found, current=5, keep=0)) == [(6, False), (6, True)]


@pytest.mark.timeout(120)
def test_a_coordinator_told_to_keep_every_version_keeps_them_across_a_restart(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    # The run's history, for benchmarks/merge_evals.py: the model after every merge.
    with tiny_coordinator(tiny_corpus, tmp_path, {"coordinator.keep_versions": 0}) as (
        running,
        learner,
        init,
    ):
        frag = running.service.fragments[0]
        for version in range(3):
            header = delta_header(learner, "fp32", f"push-{version}")
            header.version = version
            assert learner.push(header, {n: torch.randn_like(t) * 1e-3 for n, t in init.items()}).accepted
            wait_for(
                lambda v=version: frag.published_version > v, 20, f"version {version + 1} published", 0.02
            )
        config, root = running.service.config, running.service.checkpoint_root
    resumed = start_coordinator(config, str(tmp_path))
    try:
        names = sorted(p.name for p in Path(root).iterdir())
        assert names == [f"fragment-0-v0000000{v}.safetensors" for v in range(4)]
        assert resumed.service.fragments[0].files == [0, 1, 2, 3]
    finally:
        resumed.stop()
