"""The evaluator: the held-out loss of the published global model while the run trains.

Learners report the loss of their own local models on their own batches; what a user wants to
watch is the global model on data no learner trains on. This role joins the run, keeps a copy of
the published parameters (pulling only fragments that changed, as a learner does), and every
`eval.every_s` evaluates the model the run has now on the same held-out rows, with the model's
own forward (so its metrics, e.g. accuracy, come too), and reports it (ReportEval). The
coordinator keeps the reports in its ledger; status, the live view and summary.json show them.

It never trains, holds no lease and pushes nothing: killing it costs the run nothing, and a new
one starts where the ledger's curve left off. Its pulls are counted apart from the learners'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import numpy as np
import torch

from diloco.client import RETRYABLE, WORKER_OUTAGE_TOLERANCE_S, CoordinatorClient
from diloco.compute.device import pick_device, set_threads
from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.evaluate import evaluate
from diloco.export import load_parameters
from diloco.model.factory import build_model
from diloco.model.recalibrate import first_rows, recalibrate
from diloco.plugins import refuse_untrusted_model
from diloco.role import heartbeat_thread, refusing
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.steps import decode_steps

log = logging.getLogger("diloco.evaluator")

# How often the evaluator looks at status while it waits for the next evaluation.
POLL_S = 1.0


@dataclass(frozen=True)
class EvalDecision:
    due: bool
    reason: str


def eval_due(
    now: float,
    last_at: float | None,
    every_s: float,
    versions: list[int],
    evaluated: list[int] | None,
    rows_ready: int,
    rows_wanted: int,
    split_complete: bool,
    every_merges: int = 0,
) -> EvalDecision:
    """Whether to evaluate now: a published model (every fragment merged at least once) that
    differs from the one evaluated last, `every_s` after the last evaluation or `every_merges`
    merges after it (whichever comes first; 0: not that way; both 0: every new model), on held-out
    rows that are all there (the rows wanted, or the whole split when it holds fewer)."""
    if not versions or min(versions) < 1:
        return EvalDecision(False, "no merged model yet")
    if rows_ready < rows_wanted and not split_complete:
        return EvalDecision(False, f"held-out rows {rows_ready}/{rows_wanted} prepared")
    if rows_ready == 0:
        return EvalDecision(False, "the held-out split is empty")
    if evaluated == versions:
        return EvalDecision(False, f"versions {versions} already evaluated")
    if last_at is None or (every_s <= 0 and every_merges <= 0):
        return EvalDecision(True, f"versions {versions}")
    merges = sum(versions) - sum(evaluated or [])
    if every_merges > 0 and merges >= every_merges:
        return EvalDecision(True, f"{merges} merges since the last evaluation")
    if every_s > 0 and now - last_at >= every_s:
        return EvalDecision(True, f"{now - last_at:.1f}s since the last evaluation")
    waits = ([f"{every_s - (now - last_at):.1f}s"] if every_s > 0 else []) + (
        [f"{every_merges - merges} merge(s)"] if every_merges > 0 else []
    )
    return EvalDecision(False, f"next evaluation in {' or '.join(waits)}")


class SplitRows:
    """The first `wanted` rows of a split's shards in chunk order (status's eval_split, or its
    recalibration_split), read once the shards holding them exist, then kept."""

    def __init__(self, wanted: int):
        self.wanted = wanted
        self.columns: dict[str, np.ndarray] | None = None
        self._from: list[str] = []

    @staticmethod
    def ready_rows(split: dict[str, Any]) -> int:
        return sum(int(s["rows"]) for s in split.get("shards", []))

    def load(self, split: dict[str, Any]) -> dict[str, np.ndarray] | None:
        shards, total = [], 0
        for s in split.get("shards", []):  # only those holding the rows wanted: later ones change nothing
            if total >= self.wanted:
                break
            shards.append(s)
            total += int(s["rows"])
        uris = [s["uri"] for s in shards]
        if self.columns is None or uris != self._from:
            self.columns, self._from = first_rows(shards, self.wanted), uris
        return self.columns


class Evaluator:
    def __init__(
        self,
        address: str,
        stop: threading.Event | None = None,
        *,
        connect_timeout_s: float = 60.0,
        worker_id: str | None = None,
        device: str | None = None,
        threads: int | None = None,
        every_s: float | None = None,
    ):
        self.client = CoordinatorClient(
            address, pb.ROLE_EVALUATOR, retry_deadline_s=WORKER_OUTAGE_TOLERANCE_S, worker_id=worker_id
        )
        self.stop = stop or threading.Event()
        self.connect_timeout_s = connect_timeout_s
        self.device_spec, self.threads, self.every_s = device, threads, every_s
        self.held: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # fragment -> (version, tensors)
        self.evaluations = 0
        self.started = time.monotonic()

    def _heartbeat(self) -> None:
        self.client.heartbeat(pb.HeartbeatRequest(wall_seconds=time.monotonic() - self.started))

    def run(self) -> int:
        reply = self.client.join(self.connect_timeout_s)
        cfg = self.client.config
        assert cfg is not None
        every_s = cfg.eval.every_s if self.every_s is None else self.every_s
        with refusing(self.client, log):
            device = pick_device(self.device_spec or "cpu")
            set_threads(self.threads if self.threads is not None else cfg.eval.threads)
            refuse_untrusted_model(cfg.model)  # the coordinator's names: imported only if allowed here
            model = build_model(cfg.model, seed=cfg.train.seed).to(device)
        rows = SplitRows(cfg.eval.max_batches * cfg.train.batch_size)
        train_rows = SplitRows(cfg.eval.recalibrate_batches * cfg.train.batch_size)
        beats = heartbeat_thread(self._heartbeat, reply.heartbeat_s, self.stop, log)
        last_at: float | None = None
        evaluated: list[int] | None = None
        try:
            while not self.stop.is_set():
                status = self.client.status()
                # A finished run's final model is evaluated at once: the curve ends where it did.
                finished = status["run_state"] == "finished"
                split = status.get("eval_split") or {}
                versions = [int(v) for v in status["fragment_versions"]]
                decision = eval_due(
                    time.monotonic(), last_at, 0.0 if finished else every_s, versions, evaluated,
                    rows.ready_rows(split), rows.wanted, bool(split.get("complete")),
                    0 if finished else cfg.eval.every_merges,
                )  # fmt: skip
                if decision.due:
                    recalibration = status.get("recalibration_split") or {}
                    held_out = rows.load(split)
                    assert held_out is not None  # (eval_due: rows are ready)
                    evaluated = self._evaluate(
                        model, device, held_out, cfg, status, partial(train_rows.load, recalibration)
                    )
                    last_at = time.monotonic()
                if finished:
                    log.info("the run finished after %d evaluation(s)", self.evaluations)
                    break
                self.stop.wait(POLL_S)
        finally:
            self.stop.set()
            self.client.leave("finished")
            self.client.close()
            beats.join(5.0)
        return 0

    def _pull(self, fragments: int) -> None:
        """Bring the held copy up to the published one: changed fragments only, as steps when the
        pull codec sends steps (decoded onto the copy held), else whole."""
        wanted = list(range(fragments))
        have = [self.held[p][0] if p in self.held else -1 for p in wanted]
        parts: dict[int, list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]] = {}
        for header, tensors in self.client.pull(wanted, have):
            parts.setdefault(header.fragment, []).append((header, tensors))
        for p, got in parts.items():
            version, base = self.held.get(p, (-1, {}))
            value = decode_steps(base, version, got)
            if value is None:  # the steps do not start at our copy: take the fragment whole
                del self.held[p]
                return self._pull(fragments)
            self.held[p] = (int(got[-1][0].version), value)

    def _evaluate(
        self, model: torch.nn.Module, device: torch.device, columns: dict[str, np.ndarray],
        cfg: RunConfig, status: dict[str, Any], train_rows: Callable[[], dict[str, np.ndarray] | None],
    ) -> list[int]:  # fmt: skip
        started = time.monotonic()
        self._pull(cfg.sync.fragments)
        tensors = {n: t for _, held in self.held.values() for n, t in held.items()}
        load_parameters(model, tensors, "the run's published model", cfg.model.factory)
        # The merged statistics are the learners' mean, not the global weights' own (recalibrate).
        recalibrated = recalibrate(
            model, rows=train_rows, batch_size=cfg.train.batch_size,
            batches=cfg.eval.recalibrate_batches, device=device,
        )  # fmt: skip
        result = evaluate(model, columns, cfg.train.batch_size, device, where=cfg.model.factory)
        versions = [self.held[p][0] for p in range(cfg.sync.fragments)]
        seconds = time.monotonic() - started
        reply = self.client.report_eval(
            pb.ReportEvalRequest(
                fragment_versions=versions,
                tokens_merged=int(status.get("tokens_merged", 0)),
                loss=result.loss,
                metrics=result.metrics,
                rows=result.rows,
                seconds=seconds,
            )
        )
        self.evaluations += 1
        log.info(
            "eval versions=%s loss=%.4f %s rows=%d in %.2fs%s%s",
            versions, result.loss, result.metrics, result.rows, seconds,
            f" (BatchNorm statistics recomputed on {recalibrated} train rows)" if recalibrated else "",
            "" if reply.accepted else f" (refused: {reply.reason})",
        )  # fmt: skip
        return versions


def run_evaluator(address: str, stop: threading.Event | None = None, **options: Any) -> int:
    try:
        return Evaluator(address, stop, **options).run()
    except grpc.RpcError as e:
        # One line with the coordinator's reason, exit 2 (the CLI's DilocoError), as a data worker
        # or learner says it: a refusal's details name what to change (the certificate's role).
        raise DilocoError(rpc_failure_line(e.code(), e.details() or "")) from None


def rpc_failure_line(code: grpc.StatusCode, details: str) -> str:
    """What a failed coordinator call tells a person: an outage that outlasted the retries, or a
    refusal, with the coordinator's own words."""
    said = f"{code.name}: {details}" if details else code.name
    if code in RETRYABLE:
        return f"the coordinator stopped answering ({said})"
    return f"the coordinator refused the evaluator ({said})"
