"""Child processes of a local job: start each role as its own OS process, and always reap them.

Used by `diloco run`, the tests and the benchmarks, so that every process started is stopped:
SIGTERM first (each role gives its leases back and exits 0), SIGKILL for whatever is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco.compute.startup import SPAWNED_AT_ENV
from diloco.local.forkserver import ForkedProcess, ForkServer
from diloco.local.spare import Assignment


@dataclass
class Child:
    name: str
    role: str
    args: list[str]
    proc: subprocess.Popen | ForkedProcess
    log_path: Path
    cpu_s: float | None = None  # user + system CPU seconds, once it has exited and been reaped
    prefix: list[str] | None = None  # the command it runs under (spawn's), kept for a respawn

    @property
    def alive(self) -> bool:
        if self.proc.returncode is not None:
            if self.cpu_s is None:  # the fork server's report (a Popen's comes from wait4 below)
                self.cpu_s = getattr(self.proc, "cpu_s", None)
            return False
        # Reaped here rather than by Popen.poll: wait4 also says how much CPU the child used.
        try:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        except ChildProcessError:  # forked by the fork server, which reaps it and says so
            if self.proc.poll() is None:
                return True
            self.cpu_s = getattr(self.proc, "cpu_s", None)
            return False
        if pid == 0:
            return True
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        return False

    def how_it_ended(self) -> str:
        """`exit code 1`, `killed by SIGKILL`: what a log without a last line cannot say."""
        code = self.proc.returncode
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


@dataclass
class ProcessGroup:
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    retired: list[Child] = field(default_factory=list)  # earlier lives of respawned children
    spares: dict[str, list[Child]] = field(default_factory=dict)  # role -> warm spares, oldest first
    spares_per_role: int = 0
    _spares_started: int = 0
    # Forks the processes from one warm interpreter (diloco.local.forkserver) once started;
    # fork=True starts it at the first spawn.
    fork_server: ForkServer | None = None
    fork: bool = False

    def use_fork_server(self) -> None:
        """From now on fork `python -m cli` processes from a warm interpreter: each starts in
        milliseconds instead of importing torch and the library again (a restart too, so no warm
        spares are kept). Commands with a prefix, or that read stdin, still get an interpreter
        of their own."""
        if self.fork_server is None:
            env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
            self.fork_server = ForkServer(self.log_dir / "forkserver.log", env)

    def spawn(
        self,
        name: str,
        role: str,
        args: list[str],
        extra_env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> Child:
        """Start `python -m cli <args>` with its output in <log_dir>/<name>.log; `prefix` is a
        command that execs it (e.g. `ip netns exec NS`, to run it in another network namespace)."""
        child = self._start(name, role, args, self.log_dir / f"{name}.log", extra_env, prefix=prefix)
        self.children.append(child)
        return child

    def _start(
        self,
        name: str,
        role: str,
        args: list[str],
        log_path: Path,
        extra_env: dict[str, str] | None = None,
        stdin: int = subprocess.DEVNULL,
        prefix: list[str] | None = None,
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.fork and self.fork_server is None:
            self.use_fork_server()
        env = {**os.environ, **self.env, **(extra_env or {})}
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[SPAWNED_AT_ENV] = repr(time.time())  # the start of a learner's start-up line
        # A Ctrl-C between fork and bookkeeping would leave a child nobody stops: hold SIGINT and
        # SIGTERM until the child is on a list (they are delivered right after).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            if self.fork_server is not None and prefix is None and stdin == subprocess.DEVNULL:
                try:
                    forked = self.fork_server.spawn(Assignment(args, str(log_path), env))
                    return Child(name, role, args, forked, log_path)
                except OSError as e:  # the server is gone: a fresh interpreter, as without it
                    print(f"warning: fork server: {e}; starting {name} on its own", file=sys.stderr)
                    self.fork_server = None
            with open(log_path, "ab") as log:
                # A session of its own: a Ctrl-C at the terminal reaches only the parent, which then
                # stops the children in order instead of all of them dying at once.
                proc = subprocess.Popen(
                    [*(prefix or []), sys.executable, "-m", "cli", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=stdin,
                    env=env,
                    start_new_session=True,
                    # ...but the child must not inherit the held signals, or SIGTERM would not reach it.
                    preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, blocked),
                )
            return Child(name, role, args, proc, log_path, prefix=prefix)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def keep_spares(self, roles: list[str], per_role: int | None = None) -> None:
        """From now on keep `per_role` warm spares (diloco.local.spare) of each role for respawn to hand a
        role to: more than one, so that kills in quick succession still find one warmed up."""
        self.spares_per_role = per_role if per_role is not None else self.spares_per_role
        if self.fork_server is not None:
            return  # every fork is as warm as a spare
        for role in roles:
            waiting = self.spares.setdefault(role, [])
            while len(waiting) < self.spares_per_role:
                self._spares_started += 1
                waiting.append(self._start(
                    f"spare-{role}",
                    role,
                    ["standby", "--role", role],
                    self.log_dir / f"spare-{role}-{self._spares_started}.log",
                    stdin=subprocess.PIPE,
                ))  # fmt: skip

    def _hand_to_spare(self, name: str, role: str, args: list[str]) -> Child | None:
        """The role's spare becomes `name` (and a new spare starts warming up); None: no live spare."""
        waiting = self.spares.get(role, [])
        if not waiting:
            return None
        spare = waiting.pop(0)  # the oldest: the one furthest into its warm-up
        log_path = self.log_dir / f"{name}.log"
        assignment = Assignment(args, str(log_path), {SPAWNED_AT_ENV: repr(time.time())})
        try:
            if not spare.alive or spare.proc.stdin is None:
                raise BrokenPipeError
            spare.proc.stdin.write(assignment.to_line())
            spare.proc.stdin.close()
        except (BrokenPipeError, OSError):
            self.retired.append(spare)
            self.keep_spares([role])
            return None
        child = Child(name, role, args, spare.proc, log_path)
        self.children.append(child)
        self.keep_spares([role])
        return child

    def all_spares(self) -> list[Child]:
        return [c for waiting in self.spares.values() for c in waiting]

    def respawn(self, child: Child, args: list[str] | None = None) -> Child:
        """Start a process again in a child's place (same name, role and, unless given, args): the
        role's warm spare when there is one, else a fresh process."""
        self.children.remove(child)
        child.alive  # noqa: B018 (reaped now, so its CPU time is known)
        self.retired.append(child)
        args = args or child.args
        if child.prefix:  # a spare runs without it (on this machine, not where the child ran)
            return self.spawn(child.name, child.role, args, prefix=child.prefix)
        return self._hand_to_spare(child.name, child.role, args) or self.spawn(child.name, child.role, args)

    def cpu_seconds_by_role(self) -> dict[str, float]:
        """CPU seconds used by the children that have exited, every life of each, by role."""
        totals: dict[str, float] = {}
        for c in [*self.retired, *self.children, *self.all_spares()]:
            if c.cpu_s is not None:
                totals[c.role] = round(totals.get(c.role, 0.0) + c.cpu_s, 2)
        return totals

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def signal(self, child: Child, sig: int) -> None:
        """To the child's whole process group (its own session). A kill -9 also goes to every
        process below the child: torchrun starts its ranks in sessions of their own, and a
        learner that is a torchrun group must die with all its ranks at once, as a dead node
        takes them (left to notice their agent is gone, rank 0 trained and pushed for up to a
        second more, and its restart then found its local state older than its last push)."""
        if child.alive:
            below = descendants(child.proc.pid) if sig == signal.SIGKILL else []
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)
            for pid in below:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def wait(self, children: list[Child], timeout_s: float) -> bool:
        """Wait until all of `children` exited; False if some are still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not any(c.alive for c in children):
                return True
            time.sleep(0.1)
        return not any(c.alive for c in children)

    def stop(self, children: list[Child] | None = None, grace_s: float = 10.0) -> None:
        """SIGTERM, wait up to grace_s, then SIGKILL; every child is reaped.

        A child that had to be killed, or exited non-zero on SIGTERM, did not stop cleanly (its
        leases, last heartbeat or leave may be missing): each gets a warning line. Ended by the
        signal itself is clean: the child had not set its handlers up yet, so it held nothing.
        """
        everyone = [*self.children, *self.all_spares()]
        targets = [c for c in (everyone if children is None else children) if c.alive]
        for c in targets:
            self.signal(c, signal.SIGTERM)
        killed = set()
        if not self.wait(targets, grace_s):
            killed = {c.name for c in targets if c.alive}
            for c in targets:
                self.signal(c, signal.SIGKILL)
        for c in targets:
            try:
                code = c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"warning: {c.name} (pid {c.proc.pid}) did not exit", file=sys.stderr)
                continue
            if c.name in killed:
                print(
                    f"warning: {c.name} did not stop within {grace_s:.0f}s of SIGTERM; killed it",
                    file=sys.stderr,
                )
            elif code not in (0, -signal.SIGTERM):
                print(f"warning: {c.name} exited {code} on SIGTERM (log: {c.log_path})", file=sys.stderr)
        if children is None and self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None

    def tail(self, child: Child, lines: int = 20) -> str:
        try:
            return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), read from /proc; [] where
    there is no /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited while read
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(parents.get(p, []))
    return found
