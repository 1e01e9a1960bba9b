"""The fuzzer (diloco.testing.fuzz) against a real coordinator: a few hundred random calls here,
ten thousand and more in benchmarks/fuzz.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from diloco.security.transport import client_channel
from diloco.testing.fuzz import (
    Tally,
    audit_ok,
    fuzz_certificates,
    fuzz_overrides,
    make_machine,
    plaintext_hosts,
)
from tests.support import tiny_coordinator

# ~300 calls, the same ones every run (the benchmark runs ten thousand and more).
SUITE_RUN = settings(
    max_examples=15,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.timeout(300)
def test_random_calls_from_several_identities_never_crash_or_poison_the_run(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    tally = Tally()
    # Two hosts (127.0.0.1 and ::1) where this machine has both: a worker id is its host's.
    host, two_hosts = plaintext_hosts()
    with tiny_coordinator(tiny_corpus, tmp_path, fuzz_overrides(), host=host) as (running, _, init):
        machine = make_machine(running, init, tally, two_hosts=two_hosts)
        run_state_machine_as_test(
            machine,
            settings=SUITE_RUN,
        )
    assert tally.calls >= 200 and tally.refused > 0, tally
    # Calls on others' objects came up, every one refused; honest pushes were taken.
    assert tally.must_refuse >= 50 and tally.must_refuse_accepted == 0, tally
    assert tally.honest > 0 and tally.accepted_pushes > 0, tally
    assert audit_ok(tmp_path) == []


@pytest.mark.timeout(300)
def test_with_certificates_every_call_from_a_stranger_the_wrong_role_or_as_someone_else_is_refused(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    """Mutual TLS: each call is made by one certificate's holder, sometimes acting as another or
    calling what its role may not (Finish, InitParameters, another role's leases, Status without
    a certificate of this CA, anything with a revoked certificate); every such call is refused
    and changes nothing."""
    mine, security = fuzz_certificates(tmp_path)
    tally = Tally()
    with tiny_coordinator(tiny_corpus, tmp_path / "run", fuzz_overrides(), security) as (running, _, init):
        address = f"127.0.0.1:{running.port}"
        channels = {who: client_channel(address, s, []) for who, s in mine.items()}
        try:
            machine = make_machine(running, init, tally, channels)
            run_state_machine_as_test(
                machine,
                settings=SUITE_RUN,
            )
        finally:
            for channel in channels.values():
                channel.close()
        assert running.service.run_state == "running"
    assert tally.calls >= 200 and tally.must_refuse >= 50 and tally.accepted_pushes > 0, tally
    assert tally.must_refuse_accepted == 0 and tally.must_refuse_refused == tally.must_refuse, tally
    assert {"finish", "init", "status", "join"} <= set(tally.by_call), tally
    # A learner's certificate revoked in the coordinator's --tls-crl: its calls came up, all refused.
    assert any("revoked" in reason for reason in tally.must_refuse_by_reason), tally
    assert audit_ok(tmp_path / "run") == []
