"""A certificate revoked during a run, as an operator would: the roles started by hand on mutual
TLS, the coordinator with --tls-crl, and `diloco certs revoke` while both learners train. The
revoked learner ends with one line naming its revocation; the other learner trains the rest of the
data, and every train token is merged once."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.coordinator.audit import audit
from diloco.local.procs import ProcessGroup
from diloco.security.certs import CRL_NAME, init_ca, issue
from tests.support import ledger_rows, run_cli, start_coordinator, tls_flags, wait_for


@pytest.mark.timeout(240)
def test_a_learner_revoked_mid_run_is_cut_off_and_the_run_ends_without_it(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    pki = tmp_path / "pki"
    init_ca(pki)
    certs = {name: issue(pki, role, name) for name, role in
             [("coordinator", "coordinator"), ("data-0", "data"), ("learner-0", "learner"), ("learner-1", "learner")]}  # fmt: skip
    workdir = tmp_path / "coord"
    group = ProcessGroup(tmp_path / "logs", fork=True)
    try:
        settings = ["data.chunk_bytes=32768", "train.inner_steps=10", "train.threads=1", "model.kwargs.n_layer=1",
                    "coordinator.lease_ttl_s=6"]  # fmt: skip
        address = start_coordinator(
            group,
            workdir,
            ["--dataset", str(tiny_corpus), *(a for s in settings for a in ("--set", s)),
             *tls_flags(certs["coordinator"]), "--tls-crl", str(pki / CRL_NAME)],
        )  # fmt: skip
        data = group.spawn("data-0", "data", ["data", "--coordinator", address, *tls_flags(certs["data-0"])])
        learners = [
            group.spawn(name, "learner", ["compute", "--coordinator", address, "--threads", "1", *tls_flags(certs[name])])
            for name in ("learner-0", "learner-1")
        ]  # fmt: skip
        pushed = "SELECT COUNT(*) FROM pushes WHERE worker_id = 'learner-1' AND state = 'merged'"
        wait_for(lambda: ledger_rows(workdir, pushed)[0][0] > 0, 120, "learner-1's first merge")
        revoked = run_cli(["certs", "revoke", "--out", str(pki), "--name", "learner-1"], timeout=60)
        assert revoked.returncode == 0 and "revoked learner learner-1" in revoked.stdout, revoked.stderr

        assert group.wait([learners[1]], timeout_s=60), "a revoked learner trained on: " + group.tail(
            learners[1]
        )
        said = group.tail(learners[1], lines=60)
        assert learners[1].proc.returncode == 2, said
        assert "learner-1 (learner, serial" in said and "operator revoked this certificate" in said, said
        assert "Traceback" not in said, said
        # The other learner trains what is left, the revoked one's lapsed leases too.
        assert group.wait([learners[0], data], timeout_s=150), group.tail(learners[0])
        assert [learners[0].proc.returncode, data.proc.returncode] == [0, 0], group.tail(learners[0])
        refused = ledger_rows(workdir, "SELECT value FROM counters WHERE name = 'calls_refused'")
        assert refused and refused[0][0] >= 1
    finally:
        group.stop()
    train_tokens = ledger_rows(workdir, "SELECT SUM(tokens) FROM shards WHERE split = 'train'")[0][0]
    report = audit(workdir)
    assert report.ok, report.violations
    assert report.facts["tokens_merged"] == train_tokens  # every train token merged, none twice
