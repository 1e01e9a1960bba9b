"""`diloco run`'s certificates: a CA in `<workdir>/tls/` and one certificate per process, so the
embedded default runs the way a real deployment should (mutual TLS, each role its identity).
Made once; a run started again in the same workdir (or a restarted process) reuses them."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.coordinator.workdir import workdir_holder
from diloco.errors import DilocoError
from diloco.local.options import learner_id
from diloco.security.certs import TlsFiles, init_ca, issue
from diloco.security.transport import Security

# The supervisor itself: it reads status and asks the run to finish.
SUPERVISOR = "supervisor"


def run_certificates(
    workdir: Path, names: dict[str, str], coordinator_hosts: tuple[str, ...] = ()
) -> dict[str, TlsFiles]:
    """name -> role: each a certificate (made when missing), by name; the coordinator's also names
    `coordinator_hosts`, the addresses it is dialled at besides loopback."""
    directory = workdir / "tls"
    if not (directory / "ca.key").exists():
        init_ca(directory, name=f"diloco run {workdir.name}")
    made = {}
    for name, role in {**names, SUPERVISOR: "operator"}.items():
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        made[name] = (
            TlsFiles(str(cert), str(key), str(directory / "ca.crt"))
            # The coordinator's again when told its addresses: an earlier run's may not name them.
            if cert.exists() and key.exists() and not (role == "coordinator" and coordinator_hosts)
            else issue(directory, role, name, hosts=coordinator_hosts if role == "coordinator" else ())
        )
    return made


def job_certificates(workdir: Path, learners: int, data_workers: int, host: str) -> dict[str, TlsFiles]:
    """Every process of a `diloco run` job its certificate, by the name it runs under; the
    coordinator's names `host` too when the job serves beyond loopback."""
    names = {"coordinator": "coordinator", "evaluator": "evaluator"}
    names.update({f"data-{i}": "data" for i in range(data_workers)})
    names.update({learner_id(i): "learner" for i in range(learners)})
    return run_certificates(workdir, names, coordinator_hosts=(host,) if host != "127.0.0.1" else ())


def tls_args(files: TlsFiles) -> list[str]:
    return ["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca]


# The identity `diloco status --workdir` reads a job's status with: an observer, which may read
# and do nothing else (the supervisor's certificate may finish the run).
WATCHER = "status"


def job_address(workdir: Path) -> tuple[str, Security]:
    """A live `diloco run` job's coordinator address (its coordinator.json) and the identity to ask
    it with: an observer's certificate from the job's CA (made once), when the job runs mutual TLS."""
    info = workdir / "coordinator.json"
    try:
        address = json.loads(info.read_text())["address"]
    except (OSError, ValueError, KeyError):
        raise DilocoError(
            f"{workdir} has no running coordinator (no {info.name}): is the job started?"
        ) from None
    if info.exists() and workdir_holder(str(workdir)) is None:  # its file outlives it
        ended = " (its results: summary.json)" if (workdir / "summary.json").exists() else ""
        raise DilocoError(f"{workdir}'s coordinator is not running: the job has ended{ended}")
    if not (workdir / "tls" / "ca.key").exists():  # --no-tls: plaintext on loopback
        return address, Security()
    return address, Security(tls=run_certificates(workdir, {WATCHER: "observer"})[WATCHER])


def coordinator_target(
    coordinator: str | None, workdir: Path | None, operator: bool = False
) -> tuple[str, Security | None]:
    """The coordinator to ask and with which identity: --coordinator with this process's flags; or
    a live `diloco run` job's --workdir, its address and (no identity flags given) the job's own:
    an observer's certificate, or with `operator` the job's supervisor's (its operator)."""
    if coordinator is not None or workdir is None:
        if coordinator is None:
            raise DilocoError("give --coordinator HOST:PORT, or --workdir of a live `diloco run`")
        return coordinator, None  # this process's flags
    address, job_security = job_address(workdir)
    if Security.from_env().mode != "none":  # an identity given: it is used
        return address, None
    if operator and job_security.tls is not None:
        return address, Security(tls=run_certificates(workdir, {})[SUPERVISOR])
    return address, job_security
