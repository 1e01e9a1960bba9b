"""The thread that saves a learner's local state (local_state) while the training thread trains.

How often the training thread copies its state is state_cadence's decision; this writer keeps the
measures it needs (when the last copy was taken, what it cost) and saves the newest copy offered,
one at a time. Before any copy it writes the push journal's entries (push_journal): each push
after the last copy, so that the copy stays resumable.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco.compute import push_journal
from diloco.compute.local_state import LocalState, pushed_count, pushed_path, save
from diloco.compute.push_journal import JournaledPush
from diloco.compute.state_cadence import copy_due
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.local_state")

HELD_LOG_EVERY_S = 300.0


class StateWriter:
    """Saves the latest offered state on a thread of its own; the training thread never waits on disk.

    A state offered while the last is still being written replaces any not yet started: only the
    newest matters, and copies never pile up."""

    def __init__(
        self,
        path: Path,
        every_s: float,
        on_saved: Callable[[LocalState], None] | None = None,
        max_share: float = 0.05,
    ):
        self.path = path
        self.every_s = every_s
        self.max_share = max_share  # of the time, the most that copies may cost (state_cadence)
        self.on_saved = on_saved  # called on the writer thread once a state is on disk
        self._closed = threading.Event()
        self._next: LocalState | None = None
        self._busy = False
        # -inf, not 0: monotonic time starts near the machine's boot, and a machine up for less
        # than every_s would wait that long for its first copy.
        self._last_offer = -math.inf
        self._journal: list[JournaledPush] = []  # pushes to write, oldest first
        self._copy_s = 0.0  # the last copy's cost: the training thread's copy...
        self._save_s = 0.0  # ...and the writer's save
        self._told_held = -math.inf  # when the log last said the budget held a copy back
        self._cond = threading.Condition()
        self.writes = 0
        # Over this life: the training thread's copies (wall) and the writer's saves (its CPU,
        # the share of a core it takes from training; the fsync's wait is not counted).
        self.copies_s = 0.0
        self.saves_cpu_s = 0.0
        self.journaled = 0  # push journal entries written
        # Pushes of work made, over every life of this learner: a fresh life (start_fresh) counts
        # anew, a resumed one goes on from its state's count (which equals the noted one).
        self.push_count = pushed_count(path) or 0
        self._thread = threading.Thread(target=self._write_forever, name="local-state", daemon=True)
        self._thread.start()

    def due(self, now: float) -> bool:
        """Time for a new copy (and the last one is on disk already)."""
        with self._cond:
            if self._busy or self._next is not None:
                return False
            verdict = copy_due(
                now,
                last_copy=self._last_offer,
                last_cost_s=self._copy_s + self._save_s,
                every_s=self.every_s,
                max_share=self.max_share,
            )
        if verdict.held_by_cost and now - self._told_held >= HELD_LOG_EVERY_S:
            # Why a large model's resumes keep less (an older copy): say so, now and then.
            log.info("local state: copy held back: %s", verdict.reason)
            self._told_held = now
        return verdict.due

    def offer(self, state: LocalState, copy_s: float = 0.0) -> None:
        """A copy to save, taken by the training thread in `copy_s` seconds."""
        with self._cond:
            self._next = state
            self._last_offer, self._copy_s = time.monotonic(), copy_s
            self.copies_s += copy_s
            self._cond.notify_all()

    def note_push(self, header: pb.TensorHeader, tensors: dict[str, torch.Tensor]) -> None:
        """On the training thread, before a push leaves: a few bytes on disk, so that a restart
        knows how many pushes came after its state (resume_decision), and the push itself queued
        for the journal (written before any further copy), which a resume replays on the state.
        The push's tensors are its own (never changed after): queued, not copied."""
        self.push_count += 1
        marker = pushed_path(self.path)
        tmp = marker.with_suffix(".pushed.tmp")
        try:
            tmp.write_text(json.dumps({"pushes": self.push_count}))
            os.replace(tmp, marker)
        except OSError as e:
            log.warning("could not note the push in %s: %s", marker, e)
        with self._cond:
            self._journal.append(JournaledPush(self.push_count, header, tensors))
            self._cond.notify_all()

    def start_fresh(self) -> None:
        """The last life's state is not resumed: it and its push count go, so that a copy left
        from it is never taken for this life's (this life's pushes count from 0 again)."""
        self.path.unlink(missing_ok=True)
        pushed_path(self.path).unlink(missing_ok=True)
        push_journal.drop(self.path)
        self.push_count = 0

    def discard(self) -> None:
        """The learner ended cleanly (its work pushed and merged): nothing is left to resume."""
        self.close()
        self.path.unlink(missing_ok=True)
        pushed_path(self.path).unlink(missing_ok=True)
        push_journal.drop(self.path)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._next = None
            self._journal.clear()
            self._cond.notify_all()
        self._closed.set()
        self._thread.join(timeout_s)

    def _write_forever(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._journal and not self._closed.is_set():
                    self._cond.wait(0.5)
                if self._journal:
                    push, state = self._journal.pop(0), None
                elif self._next is not None:
                    push, state, self._next, self._busy = None, self._next, None, True
                else:
                    return
            if push is not None:
                self._write_entry(push)
                continue
            assert state is not None
            try:
                started, cpu = time.monotonic(), time.thread_time()
                save(self.path, state)
                self._save_s = time.monotonic() - started
                self.saves_cpu_s += time.thread_time() - cpu
                self.writes += 1
                # The entries the state holds are replayed from it no more.
                push_journal.drop(self.path, upto=state.push_count)
                if self.on_saved is not None:
                    self.on_saved(state)
            except Exception as e:  # a full disk must not stop training: the next copy may land
                log.warning("could not save local state to %s: %s", self.path, e)
            finally:
                with self._cond:
                    self._busy = False

    def _write_entry(self, push: JournaledPush) -> None:
        cpu = time.thread_time()
        try:
            push_journal.write(self.path, push)
            self.journaled += 1
        except Exception as e:  # a resume is then refused (the marker counts the push), never wrong
            log.warning("could not write push %d to the journal beside %s: %s", push.count, self.path, e)
        self.saves_cpu_s += time.thread_time() - cpu

    def describe(self, busy_s: float) -> str:
        """This life's copies and what they cost, against the time in inner steps."""
        cost = self.copies_s + self.saves_cpu_s
        share = cost / busy_s if busy_s > 0 else 0.0
        return (
            f"local state: {self.writes} copies saved and {self.journaled} pushes journaled, copying "
            f"{self.copies_s:.2f}s + saving {self.saves_cpu_s:.2f}s CPU ({share:.1%} of the "
            f"{busy_s:.1f}s in inner steps)"
        )
