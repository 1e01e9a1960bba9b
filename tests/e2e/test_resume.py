"""kill -9 of a learner that keeps its local state: the same id restarts and resumes where it died."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from diloco.compute import local_state, push_journal
from diloco.compute.local_state import state_path
from diloco.compute.resume import keeps_overlap
from diloco.config import RunConfig
from diloco.local.procs import Child, ProcessGroup, descendants
from tests.support import ledger_rows, run_cli, start_coordinator

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", ["1", "2-ddp", "2-fsdp"])
def test_a_learner_killed_with_sigkill_resumes_from_its_local_state(
    tiny_corpus: Path, tmp_path: Path, ranks: str
) -> None:
    """kill -9 mid-run, the same id restarts: it resumes at its step, the run ends with every row
    merged once (the audit), and a clean end leaves no state behind. Under a token budget
    (allowances), the resumed steps are not handed in before the first allowance comes: they go
    on to their scheduled pushes (handed in, each closed a round of its own).

    The kill comes when the state is older than the learner's last push (copies every second,
    pushes every 10 steps): the resume replays the pushes after it from the push journal (a
    push no longer brings a copy forward), and the run still merges every row once.

    A learner of 2 ranks (torchrun) is killed whole and resumes from rank 0's file: under DDP rank
    1 takes rank 0's AdamW moments, else their steps would part the replicas, which the check after
    every merge refuses; under FSDP the file holds the parameters and moments gathered whole, cut
    into the ranks' shards again at the resume."""
    workdir = tmp_path / "coord"
    state_dir = tmp_path / "state"
    path = state_path(state_dir, "learner-0")
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        address = start_coordinator(group, workdir, [
            "--dataset", str(tiny_corpus), "--set", "train.threads=1", "--set", "train.inner_steps=20",
            "--set", "train.local_state_every_s=1", "--set", "data.chunk_bytes=65536",
            "--set", "train.max_tokens=1000000000",
            # Two epochs: on a loaded machine the writer's journal and fsyncs hold copies back, and
            # in one epoch the first life once ran the data out (25 s, 2 copies) before a copy
            # past step 30 with a push journaled after it was there to kill it on.
            "--set", "data.epochs=2",
            "--set", "model.kwargs.n_layer=1",  # what is tested is the resume, not the model
        ])  # fmt: skip
        group.spawn("data-0", "data", ["data", "--coordinator", address])
        args = ["compute", "--coordinator", address, "--threads", "1", "--worker-id", "learner-0",
                "--state-dir", str(state_dir)]  # fmt: skip
        if ranks != "1":
            args += ["--nproc", "2", "--data-parallel", ranks.split("-")[1]]
        learner = group.spawn("learner-0", "learner", args)

        def saved_steps() -> int:
            """The saved step, while pushes have left after the copy and the journal holds them all."""
            state = local_state.load(path, [[]] * 8) if path.exists() else None
            if state is None:
                return 0
            noted = local_state.pushed_count(path) or 0
            journaled = len(push_journal.after(path, state.push_count))
            return state.inner_steps if state.push_count < noted <= state.push_count + journaled else 0

        # Frozen (every process of the learner), the files hold still while they are read.
        deadline = time.monotonic() + 150
        while True:
            assert time.monotonic() < deadline, "the learner to keep its state past step 30, pushes journaled"
            freeze(learner, signal.SIGSTOP)
            if (saved := saved_steps()) >= 30:
                break
            freeze(learner, signal.SIGCONT)
            time.sleep(0.05)
        kept = local_state.load(path, [[]] * 8)  # the copy the resume reads (the learner is frozen)
        journal = push_journal.after(path, kept.push_count) if kept is not None else []
        group.signal(learner, signal.SIGKILL)
        assert group.wait([learner], 10)
        # The copy knows what each row it holds counts for, so the resumed life's first heartbeat
        # claims them on the token budget (counted 0 before: the run's allowances overshot).
        assert kept is not None and {s for s, _, _ in kept.row_spans()} <= set(kept.row_tokens), (
            kept.row_tokens
        )
        learner = group.respawn(learner)
        assert group.wait([learner], 150) and learner.proc.returncode == 0, group.tail(learner, 40)
        log = learner.log_path.read_text()
        resumed = [line for line in log.splitlines() if "local state: resuming at step" in line]
        assert resumed, log[-3000:]
        assert int(resumed[-1].split("resuming at step ")[1].split()[0]) >= saved
        assert "from the journal" in resumed[-1], resumed[-1]
        this_life = log[log.index(resumed[-1]) :]
        claimed = re.search(r"unmerged rows count (\d+) tokens", this_life)
        # What the resume claims is what the copy holds once the journal's pushes took their rows
        # (a push after the copy may have carried every row it held: then nothing is claimed).
        push_journal.replay(kept, journal, keeps_overlap=keeps_overlap(RunConfig()))
        assert claimed and (int(claimed.group(1)) > 0) == bool(kept.row_spans()), this_life[:2000]
        assert "start-up:" in this_life, this_life[-3000:]
        before_first_step = this_life[: this_life.index("start-up:")]
        assert "handing in" not in before_first_step, before_first_step
        assert "replicas differ" not in this_life
        if ranks != "1":  # merges came after the resume, and each compared the ranks' replicas
            compared = re.search(r"replicas equal after (\d+) merges", this_life)
            assert "rank 1 of 2" in this_life and compared and int(compared.group(1)) >= 1, this_life[-3000:]
        assert not path.exists(), "a clean end leaves nothing to resume"
        group.stop(group.by_role("data"), grace_s=30)
        group.stop(group.by_role("coordinator"), grace_s=30)
        audit = run_cli(["status", "--audit", "--workdir", str(workdir)], timeout=60)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        merged = ledger_rows(
            workdir, "SELECT COUNT(*) FROM pushes WHERE worker_id = 'learner-0' AND state = 'merged'"
        )
        assert merged[0][0] > 0
    finally:
        group.stop()


def freeze(child: Child, sig: int) -> None:
    """SIGSTOP or SIGCONT to the learner and every process below it (a torchrun group's ranks)."""
    for pid in [child.proc.pid, *descendants(child.proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
