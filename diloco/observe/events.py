"""The run's events over time: merges, evaluations, learner reports, progress samples, restarts.

Each event is one JSON object {"kind", "at", ...}. It is appended to `<workdir>/metrics.jsonl`
(a run can be plotted after the fact, with no server running), written as TensorBoard scalars
under `<workdir>/tensorboard/` (`tensorboard --logdir runs/`), and kept in memory, the latest
ones, for the status page. A restarted coordinator reads the tail of metrics.jsonl back, so the
page's curves go on across restarts.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("diloco.observe")

METRICS_LOG = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Events kept in memory for the page (a week-long run has far more; the file keeps them all).
KEEP_EVENTS = 50_000
# A progress event's rates are over at least this long (ProgressWindow): longer than the spacing
# of merges, so a sample between two merges does not read 0 and the next one twice the rate.
RATE_WINDOW_S = 30.0


def scalars(event: dict[str, Any]) -> Iterable[tuple[str, float, int]]:
    """The TensorBoard scalars of one event: (tag, value, step), the step being the tokens merged
    into the global model so far, so runs of other speeds line up."""
    kind, step = event["kind"], int(event.get("tokens_merged") or 0)
    if kind == "merge" and event.get("mean_loss") is not None:
        yield "train/round_loss", float(event["mean_loss"]), step
    elif kind == "eval":
        yield "eval/loss", float(event["loss"]), step
        for name, value in sorted((event.get("metrics") or {}).items()):
            yield f"eval/{name}", float(value), step
    elif kind == "learner" and event.get("loss"):
        yield f"learner/{event['worker_id']}/loss", float(event["loss"]), step
        yield f"learner/{event['worker_id']}/utilization", float(event.get("utilization", 0.0)), step
    elif kind == "progress":
        for key in ("merged_tokens_per_s", "wire_bytes_per_token", "learners_alive"):
            if event.get(key) is not None:
                yield f"run/{key}", float(event[key]), step


class ProgressWindow:
    """Merged tokens per second and wire bytes per merged token over the last RATE_WINDOW_S of
    progress samples (each sample: its time, the tokens merged so far and, where it says, the
    wire bytes so far). Over one sample interval (5 s) the rate alternates between 0 and twice
    the truth whenever merges are spaced wider than that."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int, int | None]] = collections.deque()

    def add(self, at: float, merged: int, wire: int | None) -> dict[str, float | None]:
        """The rates up to this sample (the first sample alone: none), and it kept for later."""
        # The newest sample at least window_s old starts the window; older ones are not needed.
        while len(self._samples) >= 2 and at - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        out: dict[str, float | None] = {}
        if self._samples and at > self._samples[0][0]:
            t0, m0, w0 = self._samples[0]
            dm = merged - m0
            out["merged_tokens_per_s"] = round(max(0, dm) / (at - t0), 1)
            if wire is not None and w0 is not None:
                out["wire_bytes_per_token"] = round((wire - w0) / dm, 1) if dm > 0 else None
        self._samples.append((at, merged, wire))
        return out


class RunEvents:
    """Where the coordinator records what happens. `directory` None: in memory only (tests, tools)."""

    def __init__(
        self,
        directory: str | Path | None,
        *,
        clock: Callable[[], float] = time.time,
        tensorboard: bool = True,
    ):
        self.clock = clock
        self.directory = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_EVENTS)
        self._file = None
        self._writer = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._recent.extend(read_events(self.directory / METRICS_LOG, last=KEEP_EVENTS))
            path = self.directory / METRICS_LOG
            cut_short = _last_byte(path) not in (b"", b"\n")
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
            if cut_short:  # a kill mid-line: the next event starts a line of its own
                self._file.write("\n")
            if tensorboard:
                self._writer = _tensorboard_writer(self.directory / TENSORBOARD_DIR)
        self._window = ProgressWindow()
        self._last_step: dict[str, int] = {}  # per TensorBoard tag: its last step written
        for event in self._recent:  # an earlier life's: the window and the steps go on from them
            if event["kind"] == "progress":
                self._window.add(event["at"], int(event.get("tokens_merged") or 0), event.get("wire_bytes"))
            for tag, _, step in scalars(event):
                self._next_step(tag, step)

    @property
    def log_path(self) -> Path | None:
        return self.directory / METRICS_LOG if self.directory is not None else None

    @property
    def tensorboard_dir(self) -> Path | None:
        return self.directory / TENSORBOARD_DIR if self._writer is not None and self.directory else None

    def _next_step(self, tag: str, step: int) -> int:
        """`step` (the tokens merged), or one past the tag's last one: TensorBoard's steps of a
        tag increase, where several learner reports (or evals) can come at one tokens_merged."""
        step = max(step, self._last_step.get(tag, -1) + 1)
        self._last_step[tag] = step
        return step

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "at": round(self.clock(), 3), **fields}
        with self._lock:
            if kind == "progress" and "tokens_merged" in fields:
                # The rates over RATE_WINDOW_S, not over the one interval the caller measured.
                event.update(
                    self._window.add(event["at"], int(fields["tokens_merged"] or 0), fields.get("wire_bytes"))
                )
            self._recent.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event, sort_keys=True) + "\n")
                self._file.flush()
            if self._writer is not None:
                for tag, value, step in scalars(event):
                    self._writer.add_scalar(
                        tag, value, global_step=self._next_step(tag, step), walltime=event["at"]
                    )
        return event

    def recent(self, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
        wanted = set(kinds) if kinds is not None else None
        with self._lock:
            return [e for e in self._recent if wanted is None or e["kind"] in wanted]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def read_events(path: Path, last: int | None = None) -> list[dict[str, Any]]:
    """The events of a metrics.jsonl (the `last` ones); a line cut short by a kill is skipped.

    With `last`, only the file's tail is read: a week's log holds millions of events, and a
    restarted coordinator reads them back before it serves."""
    if not path.exists():
        return []
    if last is None:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    else:
        lines = _tail_lines(path, last)
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
    return events


def _tail_lines(path: Path, last: int, block: int = 1 << 20) -> list[bytes]:
    """The file's last `last` lines, read backwards a block at a time."""
    if last <= 0:
        return []
    blocks: list[bytes] = []
    newlines = 0
    with open(path, "rb") as f:
        at = f.seek(0, 2)
        # One line more than asked: the first one a block starts in may be cut by the block.
        while at > 0 and newlines <= last:
            step = min(at, block)
            at -= step
            f.seek(at)
            blocks.append(f.read(step))
            newlines += blocks[-1].count(b"\n")
    lines = b"".join(reversed(blocks)).splitlines()
    if at > 0:
        lines = lines[1:]  # it began before the first block read
    return lines[-last:]


def _last_byte(path: Path) -> bytes:
    if not path.exists() or path.stat().st_size == 0:
        return b""
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def _tensorboard_writer(directory: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard not installed: metrics.jsonl still has everything
        log.warning("no TensorBoard event files (%s); metrics.jsonl has the same curves", e)
        return None
    return SummaryWriter(log_dir=str(directory), flush_secs=5)
