"""`diloco run`'s certificates: a CA in `<workdir>/tls/` and one certificate per process, so the
embedded default runs the way a real deployment should (mutual TLS, each role its identity).
Made once; a run started again in the same workdir (or a restarted process) reuses them."""

from __future__ import annotations

from pathlib import Path

from diloco.security.certs import TlsFiles, init_ca, issue

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
    names.update({f"learner-{i}": "learner" for i in range(learners)})
    return run_certificates(workdir, names, coordinator_hosts=(host,) if host != "127.0.0.1" else ())


def tls_args(files: TlsFiles) -> list[str]:
    return ["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca]
