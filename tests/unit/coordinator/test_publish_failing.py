"""Merges the coordinator cannot save (a full disk) are shown in its status, since when and why,
and clear once a save succeeds; the job's supervisor stops on them (local.outcome.saving_failed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diloco.coordinator import checkpoint
from tests.support import PLAIN_OUTER_STEP, delta_header, tiny_coordinator, uniform_delta


@pytest.mark.timeout(120)
def test_merges_that_cannot_be_saved_show_in_status_until_one_is(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = checkpoint.save_fragment
    full = {"disk": True}

    def save_unless_full(*args, **kwargs):  # type: ignore[no-untyped-def]
        if full["disk"]:
            raise OSError(28, "No space left on device", "/runs/r5/checkpoints/f0")
        return save(*args, **kwargs)

    with tiny_coordinator(tiny_corpus, tmp_path, PLAIN_OUTER_STEP) as (running, learner, init):
        monkeypatch.setattr(checkpoint, "save_fragment", save_unless_full)  # after the initial one
        service = running.service
        assert service.status_detail()["publish_failing"] is None
        delta, _ = uniform_delta(init)
        assert learner.push(delta_header(learner, "fp32", "push-0"), delta).accepted
        deadline = time.monotonic() + 20
        while service.status_detail()["publish_failing"] is None:
            assert time.monotonic() < deadline, "the failing save was not shown"
            time.sleep(0.05)
        failing = service.status_detail()["publish_failing"]
        assert "No space left on device" in failing["error"] and failing["seconds"] >= 0
        assert service.fragments[0].published_version == 0  # kept in memory, not published
        full["disk"] = False  # space freed: the next try saves, and status clears
        while service.status_detail()["publish_failing"] is not None:
            assert time.monotonic() < deadline + 20, "a successful save did not clear it"
            time.sleep(0.05)
        assert service.fragments[0].published_version >= 1
        assert service.status_detail()["last_merge_s"] is not None  # saved: "last merge N s ago"
