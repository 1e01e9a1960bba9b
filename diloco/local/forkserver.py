"""A fork server: one interpreter that has imported torch and the library forks a job's processes.

Each process of a local job used to start its own interpreter and import torch, grpc and the
library: about 2.4 CPU-seconds each (measured on this 2-core machine, under load), six processes
per `diloco run`, again at every restart. A fork of an interpreter that has imported all of that
starts in milliseconds and shares the imported pages. The server only imports: no torch op, no
gRPC channel, no thread before a fork, so each child starts as clean as a fresh process (it
configures its own logging, threads and seeds as it always did).

The protocol is JSON lines. The supervisor writes an Assignment (diloco.local.spare) per process
on the server's stdin; the server forks, the child takes a session of its own, takes the
assignment over (log, environment) and runs the CLI with its arguments; the server answers
{"started": pid}. The server is the children's parent: it reaps each one and reports
{"exited": pid, "code": exit code (negative: the signal), "cpu": user + system seconds}, so the
supervisor keeps what wait4 gave it for its own children.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from diloco.local.spare import Assignment, run_assignment

# -- the server ----------------------------------------------------------------------------------


def warm_up() -> None:
    """Import what every role imports. Only imports: a thread or a torch op before a fork would be
    copied into every child half-made."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the first AdamW built imports it: ~1 s more per learner)

    import cli.main  # noqa: F401
    import diloco.compute.learner  # noqa: F401
    import diloco.coordinator.server  # noqa: F401
    import diloco.data.worker  # noqa: F401


def _become_child(inherited: set[int]) -> None:
    """In the forked child, before it runs its assignment: the state a fresh process starts with
    (its own session, default signal handling, stdin from /dev/null, none of the server's fds)."""
    os.setsid()  # its own session, as Popen(start_new_session=True) gave it
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt, as ever
    # SIGPIPE ignored, as the interpreter sets it at start-up: a write to a closed socket or pipe is
    # then a BrokenPipeError. At its default it ended the process with no word in its log: a browser
    # that closed its connection mid-reply killed the coordinator serving the status page.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # stdin: nothing (the server's pipe stays the server's)
    os.close(null)
    for fd in inherited - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0)  # noqa: SIM115 (the process's own stdin, /dev/null)


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """Fork a child per assignment line, report each start and each exit; return at EOF."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)  # drained until empty: a read must not wait for the next signal
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us, by closing stdin
    sel = selectors.DefaultSelector()
    sel.register(stdin, selectors.EVENT_READ, "assignment")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    reader = _Lines(stdin.fileno())

    def say(message: dict) -> None:
        stdout.write((json.dumps(message) + "\n").encode())
        stdout.flush()

    def reap() -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            say(
                {
                    "exited": pid,
                    "code": os.waitstatus_to_exitcode(status),
                    "cpu": usage.ru_utime + usage.ru_stime,
                }
            )

    inherited = {stdin.fileno(), stdout.fileno(), wake_r, wake_w}
    open_ = True
    while open_:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "child":
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                continue
            lines = reader.read()
            if lines is None:
                open_ = False
                break
            for line in lines:
                assignment = Assignment.from_line(line)
                pid = os.fork()
                if pid == 0:
                    # The child: its SystemExit unwinds out of this loop and ends the interpreter
                    # as any process ends (non-daemon threads joined, atexit handlers run).
                    sel.close()  # the child's copy (closed as an object: nothing closes it again)
                    _become_child(inherited)
                    run_assignment(assignment)
                say({"started": pid})
        reap()
    reap()


class _Lines:
    """Whole lines from a pipe read without blocking past what select said is there."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def read(self) -> list[str] | None:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines if line.strip()]


# -- the supervisor's side -----------------------------------------------------------------------


class ForkedProcess:
    """What procs.Child needs of a Popen, for a process the fork server started and reaps."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        self.stdin = None
        self._exited = threading.Event()

    def _ended(self, code: int, cpu_s: float | None) -> None:
        self.returncode, self.cpu_s = code, cpu_s
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """Starts the server (`python -m diloco.local.forkserver`) and forks processes through it."""

    def __init__(self, log_path: Path, env: dict[str, str]):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diloco.local.forkserver"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
            )  # fmt: skip
        self._lock = threading.Lock()  # one assignment at a time: its answer is the next "started"
        self._started: list[int] = []
        self._cond = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, tuple[int, float]] = {}  # exits heard before their start was taken
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()

    def spawn(self, assignment: Assignment, timeout_s: float = 60.0) -> ForkedProcess:
        """Fork one process; raises OSError when the server is gone or does not answer."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(assignment.to_line())
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            with self._cond:
                while not self._started:
                    left = deadline - time.monotonic()
                    if left <= 0 or self.proc.poll() is not None:
                        raise OSError("the fork server did not start the process")
                    self._cond.wait(min(left, 0.5))
                pid = self._started.pop(0)
                child = self._children[pid] = ForkedProcess(pid)
                if pid in self._early:
                    child._ended(*self._early.pop(pid))
        return child

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            message = json.loads(raw)
            with self._cond:
                if "started" in message:
                    self._started.append(int(message["started"]))
                elif "exited" in message:
                    pid, ended = int(message["exited"]), (int(message["code"]), float(message["cpu"]))
                    if pid in self._children:
                        self._children[pid]._ended(*ended)
                    else:
                        self._early[pid] = ended
                self._cond.notify_all()
        # The server is gone: its children were reparented and nobody can tell how they end, so
        # a process that is no longer there counts as killed.
        with self._cond:
            for child in self._children.values():
                if child.returncode is None:
                    _watch_orphan(child)
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server (its children are the supervisor's to stop first)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _watch_orphan(child: ForkedProcess) -> None:
    def watch() -> None:
        while True:
            try:
                os.kill(child.pid, 0)
            except ProcessLookupError:
                child._ended(-signal.SIGKILL, None)
                return
            except PermissionError:
                pass
            time.sleep(0.2)

    threading.Thread(target=watch, name=f"orphan-{child.pid}", daemon=True).start()


if __name__ == "__main__":
    warm_up()
    # The imported objects move to a generation the collector never scans: a child's collections
    # would otherwise touch every page of them, and copy-on-write would copy them all.
    gc.freeze()
    serve(sys.stdin.buffer, sys.stdout.buffer)
