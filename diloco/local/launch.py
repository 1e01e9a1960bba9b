"""`diloco run`: a whole job on this machine, every role its own process (on 127.0.0.1 unless told).

    coordinator ── data workers (raw chunks -> shards)
               └── learners (shards -> inner steps -> deltas -> merged globals)

It shows live progress, stops the job at its time or token budget, evaluates the final global
model on the held-out split, prints a sample, and writes runs/<name>/summary.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.live import Live

from diloco.client import CoordinatorClient
from diloco.coordinator.held_out import no_eval_split_warning
from diloco.coordinator.workdir import check_same_dataset, dataset_files, recorded_dataset, workdir_holder
from diloco.errors import DilocoError, Terminated
from diloco.local.chaos import CHAOS_ROLES, ChaosMonkey, ChaosPlan
from diloco.local.options import LocalRunOptions, default_run_config, learner_id
from diloco.local.outcome import (
    RecordedRun,
    data_workers_failed,
    failure_causes,
    finished_run_refusal,
    job_outcome,
    recorded_config,
    recorded_run,
    resume_notes,
    saving_failed,
)
from diloco.local.prepared import wait_until_prepared
from diloco.local.procs import Child, ProcessGroup
from diloco.local.summary import cold_start_warning, few_outer_steps_warning, job_report, summarize
from diloco.local.tls import SUPERVISOR, job_certificates, tls_args
from diloco.model.factory import kwargs_problem
from diloco.security.certs import TlsFiles
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb
from diloco.views import print_summary, progress_line, progress_table

# The CLI and the benchmarks take the options and the default config from here, with the job.
__all__ = ["LocalRun", "LocalRunOptions", "default_run_config", "run_local"]

# How long a child may take to stop on SIGTERM before it is killed.
STOP_GRACE_S = 15.0
FINAL_STATUS_WAIT_S = 30.0


# DILOCO_FORK_SERVER=0: every process of the job starts its own interpreter (diloco.local.forkserver).
FORK_SERVER_ENV = "DILOCO_FORK_SERVER"


def observe_ports(info: dict[str, Any]) -> list[str]:
    """The HTTP ports a coordinator took (coordinator.json), as flags that take them again."""
    flags = []
    for key in ("http_port", "metrics_port"):
        if info.get(key):
            flags += [f"--{key.replace('_', '-')}", str(info[key])]
    return flags


@dataclass
class LocalRun:
    options: LocalRunOptions
    console: Console = field(default_factory=lambda: Console(stderr=True))

    def __post_init__(self) -> None:
        o = self.options
        self.name = o.name or o.config.name or datetime.now().strftime("run-%Y%m%d-%H%M%S")
        self.workdir = Path(o.workdir or Path("runs") / self.name).resolve()
        self.config = o.job_config(self.name)
        self.certificates: dict[str, TlsFiles] = {}  # made at start when options.tls
        self.before: RecordedRun | None = None  # the workdir's run as the job found it
        self.group = ProcessGroup(
            self.workdir / "logs",
            env={"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"},
            fork=os.environ.get(FORK_SERVER_ENV, "1") != "0",  # the server starts with the first child
        )
        self.chaos = (
            ChaosMonkey(
                ChaosPlan(o.chaos_interval, self.config.train.seed, o.chaos_roles or CHAOS_ROLES),
                self.group,
                say=self.console.print,
                # a spare is one process; a learner of several ranks is a torchrun group
                spare_learners=max(o.learner_ranks) == 1,
            )
            if o.chaos_interval
            else None
        )

    # -- processes ------------------------------------------------------------------------------

    def _tls(self, name: str) -> list[str]:
        """The TLS flags of one process of the job (none when the job runs plaintext)."""
        return tls_args(self.certificates[name]) if self.certificates else []

    def _supervisor_security(self) -> Security:
        return Security(tls=self.certificates[SUPERVISOR]) if self.certificates else Security()

    def _start_coordinator(self) -> str:
        info_path = self.workdir / "coordinator.json"
        info_path.unlink(missing_ok=True)
        config_path = self.workdir / "run.toml"
        config_path.write_text(self.config.to_toml())
        args = [
            "coordinator",
            "--workdir",
            str(self.workdir),
            "--config",
            str(config_path),
            "--host",
            self.options.host,
        ]
        o = self.options
        for flag, port in (("--http-port", o.http_port), ("--metrics-port", o.metrics_port)):
            if port is not None:
                args += [flag, str(port)]
        args += self._tls("coordinator")
        coordinator = self.group.spawn("coordinator", "coordinator", [*args, "--port", "0"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if info_path.exists():
                info = json.loads(info_path.read_text())
                # A restarted coordinator comes back on the same ports: the workers (and the
                # page's reader) only know those.
                coordinator.args = [*args, "--port", str(info["port"]), *observe_ports(info)]
                if info.get("page_url"):
                    self.console.print(f"status page: {info['page_url']}", highlight=False, soft_wrap=True)
                self.console.print(
                    f"status: diloco status --workdir {self.workdir}", highlight=False, soft_wrap=True
                )
                return info["address"]
            if not coordinator.alive:
                raise DilocoError(f"coordinator exited early: {self._reason(coordinator)}")
            time.sleep(0.1)
        raise DilocoError("coordinator did not start within 120 s")

    def _reason(self, child: Child) -> str:
        """Why a child stopped: its own `error:` line when it refused, else the end of its log."""
        tail = self.group.tail(child)
        refusals = [line.removeprefix("error: ") for line in tail.splitlines() if line.startswith("error: ")]
        return refusals[-1] if refusals else f"\n{tail}"

    def _own_code(self, role: str) -> list[str]:
        """This run's own names, a child's operator's word: the code it may import, the data it reads."""
        from diloco.data.worker import dataset_roots

        if role != "data":
            return ["--model", self.config.model.factory]
        d = self.config.data
        roots = [a for root in dataset_roots(d.dataset) for a in ("--read-root", root)]
        return [*roots, *(["--preprocess", d.preprocess] if d.preprocess else [])]

    def _start_data_workers(self, address: str) -> None:
        for i in range(self.options.data_workers):
            args = ["data", "--coordinator", address, "--worker-id", f"data-{i}", *self._tls(f"data-{i}")]
            args += self._own_code("data")
            self.group.spawn(f"data-{i}", "data", args)

    def _start_learners(self, address: str) -> None:
        """The learners, and the evaluator that follows them."""
        o = self.options
        for i in range(o.learners):
            args = ["compute", "--coordinator", address, "--threads", str(self.config.train.threads)]
            args += ["--worker-id", learner_id(i)]
            args += ["--state-dir", str(self.workdir / "learner-state"), *self._own_code("learner")]
            if i == o.learners - 1 and o.slow_learner > 1.0:
                args += ["--slow-factor", str(o.slow_learner)]
            if o.ranks_of(i) > 1:
                args += ["--nproc", str(o.ranks_of(i)), "--data-parallel", o.data_parallel]
            prefix = shlex.split(o.learner_prefix.format(i=i)) if o.learner_prefix else None
            self.group.spawn(learner_id(i), "learner", [*args, *self._tls(learner_id(i))], prefix=prefix)
        if (
            self.config.eval.every_s > 0 or self.config.eval.every_merges > 0
        ):  # the held-out loss of the global model, while it trains
            # On the learners' device: a model sized for a GPU takes minutes per evaluation on one
            # CPU thread (auto is the CPU on a machine without one).
            args = ["evaluator", "--coordinator", address, "--worker-id", "evaluator",
                    "--device", self.config.train.device, *self._tls("evaluator"), *self._own_code("evaluator")]  # fmt: skip
            self.group.spawn("evaluator", "evaluator", args)

    def _stop_children(self) -> None:
        """Workers first, while the coordinator still answers: each returns its leases, sends its
        last heartbeat and leaves, then exits 0. Then the coordinator."""
        workers = [c for c in self.group.children if c.role != "coordinator"]
        try:
            self.group.stop(workers, grace_s=STOP_GRACE_S)
        finally:  # a second Ctrl-C cuts the workers' grace short, not the coordinator's stop
            self.group.stop(grace_s=STOP_GRACE_S)

    # -- the job --------------------------------------------------------------------------------

    def _check_inputs(self) -> None:
        """Refuse bad input here, in one line, before a child starts or the workdir is made: the
        coordinator would refuse it too, but only after the job's set-up."""
        if holder := workdir_holder(str(self.workdir)):
            raise DilocoError(
                f"{self.workdir} is in use: its coordinator (pid {holder}) is running; watch that job with "
                f"`diloco status --workdir {self.workdir}`, or give this one another --workdir"
            )
        self.before = recorded_run(self.workdir)  # a resumed run's counts: this job's are on top
        if refusal := finished_run_refusal(self.before, self.workdir):
            raise DilocoError(refusal)
        check_same_dataset(recorded_dataset(str(self.workdir)), self.config, str(self.workdir))
        dataset_files(self.config)
        if self.before is None and (problem := kwargs_problem(self.config.model)):
            raise DilocoError(problem)  # (a resumed run builds the model it recorded)

    def _check_outcome(self, causes: dict[str, str], detail: dict[str, Any], seconds: float) -> None:
        """A job that merged nothing ends in its causes, not in a table of zeros; one that did
        still says what failed."""
        if warning := job_outcome(causes, detail, self.before, seconds, self.workdir):
            self.console.print(warning, highlight=False, soft_wrap=True)

    def run(self) -> dict[str, Any]:
        self._check_inputs()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.options.tls:
            o = self.options
            self.certificates = job_certificates(self.workdir, o.learners, o.data_workers, o.host)
        started = time.monotonic()
        started_at = time.time()
        self.console.print(
            f"[bold]diloco run[/] {self.name}: {self.options.learners} learners, "
            f"{self.options.data_workers} data workers, workdir {self.workdir}",
            soft_wrap=True,  # a path is copied whole: never wrapped
        )
        for note in resume_notes(self.before, self.workdir, self.config):
            self.console.print(note, highlight=False, soft_wrap=True)
        # About a run's start: a resumed run goes on with its recorded settings and what it did.
        fresh = self.before is None
        for warning in (
            cold_start_warning(self.config) if fresh else None,
            few_outer_steps_warning(self.config, self.options.learners) if fresh else None,
        ):
            if warning:
                self.console.print(f"[yellow]warning:[/] {warning}")
        opened: list[CoordinatorClient] = []
        try:
            address = self._start_coordinator()
            if warning := no_eval_split_warning(self.workdir, self.config):
                self.console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
            observer = CoordinatorClient(address, pb.ROLE_OBSERVER, security=self._supervisor_security())
            opened.append(observer)
            self._start_data_workers(address)
            if self.options.prepare_first:
                reading = wait_until_prepared(
                    lambda: self._status(observer),
                    lambda: self._keep_coordinator() or any(c.alive for c in self.group.by_role("data")),
                    started + self.options.minutes * 60 if self.options.minutes > 0 else math.inf,
                    self.console.print,
                )
                self.console.print(f"data prepared ({reading}) in {time.monotonic() - started:.1f} s")
            self._start_learners(address)
            detail = self._watch(observer, started)
            train_seconds = time.monotonic() - started
            self._wind_down(observer)
            detail = self._final_status(observer, detail)
            causes = failure_causes(self.group)
        finally:
            for client in opened:  # its channel too when the watch failed
                client.close()
            self._stop_children()
        self._check_outcome(causes, detail, train_seconds)
        o = self.options
        # A resumed run ran on the settings it started with (the coordinator's), not this job's.
        run_config = (recorded_config(self.workdir) if self.before else None) or self.config
        summary = summarize(
            detail, run_config, name=self.name, workdir=self.workdir, learners=o.learners,
            data_workers=o.data_workers, slow_learner=o.slow_learner, train_seconds=train_seconds,
            total_seconds=time.monotonic() - started, minutes=o.minutes, earlier=self.before,
        )  # fmt: skip
        report = job_report(detail, summary, workdir=self.workdir, learners=o.learners,
                            train_seconds=train_seconds, started_at=started_at)  # fmt: skip
        summary.update(
            report,
            ranks_per_learner={learner_id(i): o.ranks_of(i) for i in range(o.learners)},
            kills=self.chaos.kills if self.chaos else {},
            # Every kill as it happened (wall clock, process, role), to line merges up against.
            kill_log=self.chaos.kill_log if self.chaos else [],
            started_at=round(started_at, 3),  # wall clock, as kill_log's times
            # Where the machine's time went: learners' arithmetic, or the parts around it.
            cpu_seconds_by_role=self.group.cpu_seconds_by_role(),
        )
        (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _status(self, observer: CoordinatorClient) -> dict[str, Any] | None:
        try:
            return observer.status(once=True)
        except (grpc.RpcError, DilocoError):  # unreachable for now; anything else is a bug to see
            return None

    def _final_status(self, observer: CoordinatorClient, last: dict[str, Any]) -> dict[str, Any]:
        """The figures the summary reports, read once every learner has left. The watch loop's
        last reading can be half a second old, between a learner's heartbeat (tokens trained) and
        its final merge (tokens merged): a summary built on it is wrong, so the read is retried
        (the coordinator still runs; only _stop_children stops it), and said when it fails."""
        try:
            return observer.status(retry_for_s=FINAL_STATUS_WAIT_S)
        except Exception as e:
            self.console.print(
                f"[yellow]warning:[/] the coordinator's final status could not be read ({e}); "
                "the summary shows its last reading while the run trained",
                highlight=False,
                soft_wrap=True,
            )
            return last

    def _watch(self, observer: CoordinatorClient, started: float) -> dict[str, Any]:
        """Show progress until every learner has exited; ask the coordinator to finish at the deadline."""
        deadline = started + self.options.minutes * 60 if self.options.minutes > 0 else math.inf
        detail: dict[str, Any] = {}
        finish_sent = False
        if self.chaos:
            self.chaos.start(time.monotonic())
        live = Live(
            progress_table(detail, started, self.name, self.options.minutes),
            console=self.console,
            refresh_per_second=2,
        )
        last_line = 0.0
        with live if self.options.show_progress else contextlib.nullcontext():
            while any(c.alive for c in self.group.by_role("learner")):
                self._keep_coordinator()
                if self.chaos:
                    self.chaos.tick(
                        time.monotonic(), training=bool(detail.get("tokens_trained")), finishing=finish_sent
                    )
                detail = self._status(observer) or detail
                if problem := saving_failed(detail, self.workdir):
                    raise DilocoError(problem)
                if self.options.show_progress:
                    live.update(progress_table(detail, started, self.name, self.options.minutes))
                elif time.monotonic() - last_line >= 10:
                    last_line = time.monotonic()
                    self.console.print(progress_line(detail, started), highlight=False, soft_wrap=True)
                if not finish_sent and time.monotonic() >= deadline:
                    observer.finish("time budget reached")
                    finish_sent = True
                exits = [None if c.alive else c.proc.returncode for c in self.group.by_role("data")]
                if not finish_sent and data_workers_failed(exits, detail):
                    observer.finish("every data worker failed")  # their causes end the job's report
                    finish_sent = True
                time.sleep(0.5)
            if self.options.show_progress:
                live.update(progress_table(detail, started, self.name, self.options.minutes))
        if self.options.show_progress and not self.console.is_terminal:
            self.console.line()  # Live's last frame ends without one where output is a file
        return detail

    def _keep_coordinator(self) -> None:
        """A dead coordinator ends the job, or under chaos is restarted, as a supervisor would."""
        coordinator = self.group.by_role("coordinator")[0]
        if not coordinator.alive:
            if not self.chaos:
                raise DilocoError(
                    f"coordinator died ({coordinator.how_it_ended()}):\n{self.group.tail(coordinator)}"
                )
            self.group.respawn(coordinator)

    def _wind_down(self, observer: CoordinatorClient) -> None:
        with contextlib.suppress(Exception):
            observer.finish("learners finished", timeout_s=10)
        self.group.wait(self.group.by_role("data"), timeout_s=30)


def run_local(options: LocalRunOptions) -> dict[str, Any]:
    job = LocalRun(options)
    # Ctrl-C (even when started from a shell that ignores SIGINT in background jobs) and SIGTERM
    # both stop the job: every child is stopped in order by LocalRun.run's cleanup.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(Terminated()))
    try:
        summary = job.run()
    except KeyboardInterrupt:
        job.console.print(
            f"\nstopped: the run is kept in {job.workdir}; the same command (the same --workdir) resumes it",
            highlight=False,
            soft_wrap=True,
        )
        raise
    # Progress went to stderr; the result is the command's output.
    print_summary(Console(), summary, job.workdir / "summary.json")
    return summary
