"""The coordinator fuzzed at length: random sequences of valid and malformed calls from several
identities against a real coordinator (diloco.testing.fuzz), counted.

    python benchmarks/fuzz.py --examples 500 --steps 25      # about 12,500 calls
    python benchmarks/fuzz.py --mtls ...                     # every call made with a certificate

With --mtls the coordinator runs mutual TLS, each call is made by one of several certificates'
holders (learners, a data worker, an observer, an operator, a stranger from another CA, a learner
whose certificate is revoked in the coordinator's --tls-crl), and may
act as another worker or call what its role may not: every such call must be refused and change
nothing (`must_refuse` counts them). Without it, where this machine has ::1 beside 127.0.0.1,
the coordinator listens on both and two of the identities call from ::1: a call from one host as a
live worker the other host joined must be refused and change nothing (counted the same way).

Prints the calls by kind, the refusals, and pushes accepted and refused. The invariants are
checked after every call; the first that fails (a handler answering anything but a result or a
refusal, a refused push merged, a non-finite parameter) stops the run with the call sequence that
broke it. The ledger's audit runs at the end. Writes benchmarks/results/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from diloco.security.transport import client_channel  # noqa: E402
from diloco.testing.fuzz import (  # noqa: E402
    Tally,
    audit_ok,
    fuzz_certificates,
    fuzz_overrides,
    make_machine,
    plaintext_hosts,
)
from tests.support import copy_corpus, tiny_coordinator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=500)
    p.add_argument("--steps", type=int, default=25, help="calls per example (each checked after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtls", action="store_true", help="identities from certificates (mutual TLS)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/fuzz[_mtls].json")
    args = p.parse_args()
    args.out = args.out or ROOT / "benchmarks" / "results" / ("fuzz_mtls.json" if args.mtls else "fuzz.json")
    tally = Tally()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="diloco-fuzz-") as tmp:
        (Path(tmp) / "corpus").mkdir()
        corpus = copy_corpus(Path(tmp) / "corpus", 300_000)
        workdir = Path(tmp) / "coordinator"
        mine, security = fuzz_certificates(Path(tmp)) if args.mtls else ({}, None)
        # Plaintext: two hosts (127.0.0.1 and ::1) where this machine has both.
        host, two_hosts = ("127.0.0.1", False) if args.mtls else plaintext_hosts()
        with tiny_coordinator(corpus, workdir, fuzz_overrides(), security, host) as (running, _, init):
            address = f"127.0.0.1:{running.port}"
            channels = {who: client_channel(address, s, []) for who, s in mine.items()} if args.mtls else None
            machine = make_machine(running, init, tally, channels, two_hosts)
            failure: BaseException | None = None
            try:
                run_state_machine_as_test(
                    machine,
                    settings=settings(
                        max_examples=args.examples,
                        stateful_step_count=args.steps,
                        deadline=None,
                        database=None,
                        suppress_health_check=list(HealthCheck),
                    ),  # fmt: skip
                )
            except Exception as e:  # an invariant failed: the counts so far, then the sequence
                failure = e
        violations = audit_ok(workdir)
    # Reaching here means no crash: the first one stops the run with its failing call sequence.
    result = {**asdict(tally), "audit_violations": violations,
              "seconds": round(time.monotonic() - started, 1), "examples": args.examples, "steps": args.steps, "mtls": args.mtls,
              "two_hosts": two_hosts}  # fmt: skip
    print(json.dumps(result, indent=2))
    print(
        f"{tally.calls} calls in {result['seconds']} s: must be refused {tally.must_refuse} "
        f"(refused {tally.must_refuse_refused}, taken {tally.must_refuse_accepted}: defects); "
        f"honest {tally.honest} (refused {tally.honest_refused}); pushes accepted {tally.accepted_pushes}, "
        f"refused {tally.refused_pushes}; audit {violations or 'clean'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if failure is not None:
        raise failure
    if violations:
        raise SystemExit("audit failed")


if __name__ == "__main__":
    main()
