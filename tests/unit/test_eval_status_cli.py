"""`diloco eval` and `diloco status --watch` as a new user meets them: too little text is one line,
`eval --workdir` pulls a live `diloco run` job's model with an evaluator's certificate, the loss
has its unit, and a watch waits for a coordinator from its first refresh and stops once the
finished run's coordinator is gone (decided by pure functions: no sleeping here)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import grpc
import pytest

from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.observe.watch import REFUSE, STOP, WAIT, job_ended, on_outage, watch_status
from tests.support import cli, mtls_job, one_error_line, tls_flags

# Each test starts without identity flags in the environment, and what a command set is undone.
pytestmark = pytest.mark.usefixtures("no_identity_in_env")


# -- eval on too little text ------------------------------------------------------------------------


def test_eval_on_too_little_text_says_how_much_a_row_takes(tmp_path: Path) -> None:
    from diloco.results import dataset_columns, no_rows_line

    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "hello world"}\n{"text": "short"}\n')
    with pytest.raises(DilocoError, match=r"small.jsonl made no rows of model.seq_len \+ 1 = 129 tokens"):
        dataset_columns(RunConfig(), str(small))
    samples = RunConfig().with_overrides({"data.preprocess": "pkg.mod:prep"})
    line = no_rows_line(samples, "x.jsonl", "samples")
    assert "made no samples" in line and "pkg.mod:prep" in line


# -- eval's loss unit ---------------------------------------------------------------------------------


def test_eval_prints_a_token_models_loss_in_nats_per_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diloco.results as results
    from diloco.results import LoadedModel, evaluate_loaded
    from tests.toy_models import tiny_lm

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    cfg = RunConfig().with_overrides({"model.vocab_size": 257})
    loaded = LoadedModel(cfg, tiny_lm(vocab_size=257), "toy", [], [])
    result = evaluate_loaded(loaded, str(text), 1)
    assert result["loss_unit"] == "nats/token" and result["rows"] > 0

    monkeypatch.setattr(results, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(results, "evaluate_loaded", lambda *a, **k: {**result, "loss": 2.3337})
    code, out = cli("eval", str(tmp_path))
    assert code == 0 and "loss 2.3337 nats/token" in out, out
    assert "unigram baseline" in out and out.rstrip().endswith("nats/token"), out


# -- eval --workdir of a live `diloco run` job ------------------------------------------------------


@pytest.mark.timeout(120)
def test_eval_workdir_pulls_with_an_evaluator_certificate(tiny_corpus: Path, tmp_path: Path) -> None:
    """A `diloco run`-like workdir (its CA in tls/, its coordinator.json): the observer's certificate
    `status --workdir` uses is refused in one line naming what to give; `--workdir` joins with an
    evaluator's certificate of its own (so the run, with no parameters yet, says so)."""
    workdir = tmp_path / "job"
    with mtls_job(tiny_corpus, workdir) as (_, address, certs):
        code, out = cli("eval", "--coordinator", address, *tls_flags(certs["status"]))
        line = one_error_line(out)
        assert code == 2 and "refused to let this evaluator join" in line, out
        assert "--role evaluator" in line and "--workdir" in line, line
        code, out = cli("eval", "--workdir", str(workdir))
        assert code == 2 and "the run has no parameters yet" in one_error_line(out), out
        assert (workdir / "tls" / "eval.crt").exists()
    code, out = cli("eval", "--workdir", str(workdir))
    assert code == 2 and "the job has ended" in one_error_line(out), out
    code, out = cli("eval", str(workdir), "--workdir", str(workdir))
    assert code == 2 and "give one of" in one_error_line(out), out


# -- status --watch ---------------------------------------------------------------------------------


class Unavailable(grpc.RpcError):
    def __init__(
        self,
        details: str = "ipv4:127.0.0.1:7: Connection refused",
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
    ) -> None:
        self._details, self._code = details, code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def scripted(answers: list[object]):  # type: ignore[no-untyped-def]
    def fetch() -> dict:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    return fetch


def test_the_decisions_on_a_coordinator_that_does_not_answer() -> None:
    assert on_outage(None, 100.0, 105.0, "Connection refused").action == WAIT  # not answering yet
    assert on_outage("running", 100.0, 105.0, "Connection refused").action == WAIT  # restarting
    done = on_outage("finished", 100.0, 105.0, "Connection refused")
    assert (
        done.action == STOP and done.line == "run finished; its coordinator has exited (Connection refused)"
    )
    ended = on_outage("running", 100.0, 105.0, "x", ended="W's coordinator is not running: the job has ended")
    assert ended.action == STOP and ended.line.endswith("the job has ended")
    # A handshake refused from the start, for longer than the patience: a wrong identity.
    wrong = on_outage(None, 100.0, 105.0, "x", problem="the TLS handshake failed", problem_since=100.0)
    assert wrong.action == REFUSE and "the TLS handshake failed" in wrong.line
    assert on_outage(None, 100.0, 100.5, "x", problem="p", problem_since=100.0).action == WAIT  # not yet
    assert on_outage("running", 100.0, 105.0, "x", problem="p", problem_since=100.0).action == WAIT


def test_a_watch_waits_for_a_coordinator_from_its_first_refresh() -> None:
    shown: list[tuple[object, object]] = []
    t = [1000.0]

    def sleep(s: float) -> None:
        t[0] += s

    fetch = scripted([Unavailable(), Unavailable(), {"run_state": "running"}])
    watch_status(
        fetch, lambda d, down: shown.append((d, down)), 2, now=lambda: t[0], sleep=sleep, refreshes=3
    )
    assert [d for d, _ in shown] == [None, None, {"run_state": "running"}]
    assert "(0 s): Connection refused" in str(shown[0][1]) and "(2 s): Connection refused" in str(shown[1][1])


def test_a_refresh_cancelled_by_a_stopping_coordinator_is_an_outage_too() -> None:
    """A coordinator that stops cancels the calls it was serving: once, in CI, the refresh in
    flight ended the watch (exit 2) instead of waiting for the restart."""
    shown: list[object] = []
    fetch = scripted(
        [
            {"run_state": "running"},
            Unavailable("CANCELLED", grpc.StatusCode.CANCELLED),
            {"run_state": "running"},
        ]
    )
    watch_status(
        fetch, lambda d, down: shown.append(d), 1, now=lambda: 0.0, sleep=lambda s: None, refreshes=3
    )
    assert shown == [{"run_state": "running"}, None, {"run_state": "running"}]


def test_a_watch_stops_once_the_finished_runs_coordinator_is_gone() -> None:
    shown: list[tuple[object, object]] = []
    fetch = scripted([{"run_state": "running"}, {"run_state": "finished"}, Unavailable()])
    watch_status(fetch, lambda d, down: shown.append((d, down)), 1, sleep=lambda s: None)  # no refreshes cap
    assert len(shown) == 3 and str(shown[-1][1]).startswith("run finished; its coordinator has exited")


def test_a_watch_stops_when_the_workdir_says_the_job_ended() -> None:
    shown: list[tuple[object, object]] = []
    fetch = scripted([{"run_state": "running"}, Unavailable()])
    watch_status(
        fetch, lambda d, down: shown.append((d, down)), 1, sleep=lambda s: None, ended=lambda: "ended"
    )
    assert shown[-1] == (None, "ended")


def test_a_handshake_refused_from_the_start_ends_the_watch_in_one_line() -> None:
    t = [1000.0]

    def sleep(s: float) -> None:
        t[0] += s

    fetch = scripted([Unavailable("Ssl handshake failed")] * 3)
    with pytest.raises(DilocoError, match="cannot connect to the coordinator: bad identity"):
        watch_status(fetch, lambda d, down: None, 2, now=lambda: t[0], sleep=sleep,
                     handshake=lambda details: "bad identity" if "handshake" in details else "")  # fmt: skip


def write_ledger(workdir: Path, run_state: str) -> None:
    (workdir / "state").mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(workdir / "state" / "ledger.sqlite")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('run_state', ?)", (run_state,))
    db.commit()
    db.close()


def test_a_workdir_says_its_job_ended(tmp_path: Path) -> None:
    from diloco.coordinator.workdir import lock_workdir

    finished, interrupted = tmp_path / "finished", tmp_path / "interrupted"
    for workdir, state in ((finished, "finished"), (interrupted, "running")):
        write_ledger(workdir, state)
        (workdir / "coordinator.json").write_text(json.dumps({"address": "127.0.0.1:1"}))
    assert job_ended(finished) == f"{finished}'s coordinator is not running: the job has ended"
    assert job_ended(interrupted) is None  # its coordinator may be restarting: waited for
    summary = interrupted / "summary.json"
    summary.write_text("{}")
    old = time.time() - 60
    os.utime(summary, (old, old))  # an earlier job's results: this one's coordinator came after
    assert job_ended(interrupted) is None
    os.utime(summary, None)
    assert (
        job_ended(interrupted)
        == f"{interrupted}'s coordinator is not running: the job has ended (its results: summary.json)"
    )
    held = lock_workdir(str(finished))  # a coordinator runs there: nothing ended
    try:
        assert job_ended(finished) is None
    finally:
        held.close()


def test_status_watch_waits_for_a_coordinator_that_never_answered() -> None:
    code, out = cli("status", "--coordinator", "127.0.0.1:1", "--watch", "0.05", "--refreshes", "2")
    assert code == 0 and out.count("coordinator unreachable since") == 2, out
