"""Watching a live run: Prometheus scrapes the coordinator's /metrics, a real browser (headless
Chromium from Debian's packages) loads its status page, and the curves are on disk afterwards
(metrics.jsonl and TensorBoard event files). The run is mutual TLS, so its page is HTTPS and wants
an identity: the login link `diloco run` prints, the bearer token, or an observer's certificate."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families

from diloco.client import CoordinatorClient
from diloco.security.certs import TlsFiles
from diloco.security.transport import Security
from diloco.v1 import coordinator_pb2 as pb
from tests.support import QUICK_END, REPO, run_cli, wait_for

pytestmark = pytest.mark.e2e


def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return binary


def get(url: str, context: ssl.SSLContext, token: str = "") -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=10, context=context
    ) as reply:
        return reply.read().decode()


def refused(url: str, context: ssl.SSLContext) -> int:
    """The HTTP status of a request the page refuses (it raises when the page answers instead)."""
    with pytest.raises(urllib.error.HTTPError) as caught:
        get(url, context)
    return caught.value.code


def trusting(tls: Path, name: str = "") -> ssl.SSLContext:
    """A client that trusts the run's private CA, with `name`'s certificate when given."""
    context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
    if name:
        context.load_cert_chain(str(tls / f"{name}.crt"), str(tls / f"{name}.key"))
    return context


def pinned(cert: Path) -> str:
    """Chromium's pin for the coordinator's key: it trusts that key alone, not every certificate."""
    key = x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def browse(url: str, *extra: str) -> str:
    """What headless Chromium makes of the page once its scripts ran (the DOM as HTML)."""
    result = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--virtual-time-budget=2500", *extra, url],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.timeout(300)
def test_a_live_run_is_scraped_by_prometheus_and_shown_in_chromium(
    small_corpus: Path, tmp_path: Path
) -> None:
    browser = chromium()  # before the run: no run at all when the browser is missing
    assert browser
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "run", "--dataset", str(small_corpus), "--minutes", "0",
         "--workdir", str(workdir), "--no-progress", "--metrics-port", "0", "--inner-steps", "10",
         "--set", "model.kwargs.n_layer=1", "--set", "train.step_delay_s=0.2",
         "--set", "eval.every_s=3", "--set", "data.chunk_bytes=131072", "--set", "data.epochs=4", *QUICK_END],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        login = wait_for(
            lambda: next((m.group(1) for line in output
                          if (m := re.search(r"status page: (https://127\.0\.0\.1:\d+/\?token=\S+)", line))), None),
            120, "the status page's login link",
        )  # fmt: skip
        page, token = login.split("?")[0], parse_qs(urlsplit(login).query)["token"][0]
        info_path = workdir / "coordinator.json"
        info = json.loads(info_path.read_text())
        assert info["page_url"] == login
        assert info["metrics_url"] != page + "metrics"  # --metrics-port: its own
        assert info_path.stat().st_mode & 0o077 == 0  # it holds the token: its owner's alone
        assert (workdir / "http_token").read_text().strip() == token  # Prometheus's bearer_token_file
        tls_dir = workdir / "tls"
        ca = trusting(tls_dir)

        # Without credentials, or with a learner's certificate: refused. An observer's opens it.
        assert refused(page + "api/status", ca) == 401 and refused(info["metrics_url"], ca) == 401
        assert refused(page + "api/status", trusting(tls_dir, "learner-0")) == 401
        observer = run_cli(
            ["certs", "issue", "--out", str(tls_dir), "--role", "observer", "--name", "watcher"], timeout=60
        )
        assert observer.returncode == 0, observer.stderr
        # The refusals are counted as refused RPCs are.
        assert json.loads(get(page + "api/status", trusting(tls_dir, "watcher")))["calls_refused"] >= 3
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(page, ssl.create_default_context(), token)  # the run's CA is its own, no one else's
        with pytest.raises((OSError, http.client.HTTPException)):  # no plaintext beside the HTTPS
            urllib.request.urlopen(page.replace("https:", "http:"), timeout=10)

        def ready() -> bool:
            d = json.loads(get(page + "api/status", ca, token))
            learners = [
                w for w in d["workers"] if w["role"] == "compute" and w["alive"] and w.get("last_loss")
            ]
            return len(learners) == 2 and d["rounds"] >= 2 and bool(d["evals"])

        wait_for(ready, 150, "two learners training, two merges and an evaluation")
        # `diloco status --workdir` finds the live job and asks as an observer from the job's CA.
        seen = run_cli(["status", "--workdir", str(workdir), "--json"], timeout=60)
        assert seen.returncode == 0, seen.stderr
        assert json.loads(seen.stdout)["rounds"] >= 2 and (tls_dir / "status.crt").exists()
        assert "status: diloco status --workdir" in "".join(output)

        # The live run's latest model, from the command line: evaluated and exported. The job
        # runs mutual TLS (certificates in <workdir>/tls): a user's own tools get one from its CA.
        issued = run_cli(
            ["certs", "issue", "--out", str(tls_dir), "--role", "evaluator", "--name", "cli"],
            timeout=60,
        )
        assert issued.returncode == 0, issued.stderr
        tls = issued.stdout.split()
        plain = run_cli(["eval", "--coordinator", info["address"], "--json"], timeout=90)
        assert plain.returncode != 0 and "it runs TLS" in plain.stderr  # no certificate, no model
        live = run_cli(
            ["eval", "--coordinator", info["address"], "--json", "--max-batches", "4", *tls], timeout=90
        )
        assert live.returncode == 0, live.stderr
        evaluated_live = json.loads(live.stdout)
        assert evaluated_live["rows"] == 4 * 16 and info["address"] in evaluated_live["model"]
        exported = run_cli(
            ["export", "--coordinator", info["address"], "--out", str(tmp_path / "live"), *tls], timeout=90
        )
        assert exported.returncode == 0, exported.stderr
        assert json.loads((tmp_path / "live" / "config.json").read_text())["versions"], exported.stdout

        # Prometheus: the text exposition parses, and says what the run is doing.
        families = {f.name: f for f in text_string_to_metric_families(get(info["metrics_url"], ca, token))}
        value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
        assert value["diloco_tokens_merged_total"] > 0 and value["diloco_rounds_total"] >= 2
        assert value["diloco_push_seconds_count"] >= 2 and value["diloco_push_bytes_sum"] > 0
        assert value["diloco_eval_loss"] > 0
        running = [s for s in families["diloco_run_state"].samples if s.labels["state"] == "running"]
        assert running[0].value == 1
        up = {
            s.labels["worker"] for s in families["diloco_worker_up"].samples if s.labels["role"] == "compute"
        }
        assert up == {"learner-0", "learner-1"}
        assert {s.labels["role"] for s in families["diloco_pull_bytes"].samples} >= {"compute", "evaluator"}
        assert get(page + "metrics", ca, token).startswith("# HELP")  # the page's port serves /metrics too

        # A real browser, told to trust the coordinator's key: without the link it gets the
        # refusal; the link logs it in (a cookie), and the page's own requests carry that cookie:
        # the learners' rows and curves with points, and a screenshot of it all.
        pin = f"--ignore-certificate-errors-spki-list={pinned(tls_dir / 'coordinator.crt')}"

        def trust(profile: str) -> list[str]:
            # A profile of its own per launch: one still shutting down would take the next
            # launch's work over (Chromium's single instance per profile) and it would do nothing.
            return [f"--user-data-dir={tmp_path / 'chromium' / profile}", pin]

        dom = browse(page, "--dump-dom", *trust("refused"))
        assert "no credentials" in dom and "data-loaded" not in dom, dom[:2000]
        dom = browse(login, "--dump-dom", *trust("page"))
        assert 'data-loaded="true"' in dom, dom[:2000]
        assert len(re.findall(r'<tr class="learner[^"]*" data-worker="learner-\d"', dom)) == 2, dom
        points = [int(n) for n in re.findall(r'class="curve" data-name="[^"]*" data-points="(\d+)"', dom)]
        assert points and max(points) >= 2, dom
        shot = tmp_path / "page.png"
        browse(login, f"--screenshot={shot}", "--window-size=1280,1800", *trust("screenshot"))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

        # Seen enough: the run is asked to finish (as an operator would), and ends as ever.
        supervisor = Security(
            tls=TlsFiles(*(str(tls_dir / f) for f in ("supervisor.crt", "supervisor.key", "ca.crt")))
        )
        with contextlib.closing(
            CoordinatorClient(info["address"], pb.ROLE_OBSERVER, security=supervisor)
        ) as operator:
            operator.finish("the test has seen the page")
        assert proc.wait(timeout=150) == 0, "".join(output)[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        # Shown only when the test fails: what the job said (a child that died, and its last lines).
        print("".join(output)[-6000:])
    # After the run, with no server: the model evaluated and sampled, and the curves on disk.
    summary = json.loads((workdir / "summary.json").read_text())
    evaluated = run_cli(["eval", str(workdir), "--json", "--max-batches", "4"], timeout=90)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    samples = [
        run_cli(["generate", str(workdir), "--prompt", "def f", "--seed", "3"], timeout=90) for _ in "ab"
    ]
    assert samples[0].returncode == 0 and samples[0].stdout.startswith("def f"), samples[0].stderr
    assert samples[0].stdout == samples[1].stdout  # the same seed, the same text
    elsewhere = run_cli(["eval", str(workdir), "--device", "tpu"], timeout=90)
    assert elsewhere.returncode != 0 and "unknown device 'tpu'" in elsewhere.stderr, elsewhere.stderr
    kinds = {json.loads(line)["kind"] for line in Path(summary["metrics_log"]).read_text().splitlines()}
    assert {"start", "join", "merge", "learner", "eval", "progress"} <= kinds
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(summary["tensorboard_dir"])
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/round_loss", "eval/loss", "learner/learner-0/loss"} <= tags, tags
    assert len(board.Scalars("train/round_loss")) >= 2
