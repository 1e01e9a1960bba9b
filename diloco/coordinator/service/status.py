"""Finish and Status: what operators ask and see."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc

from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.evals import STATUS_EVALS
from diloco.coordinator.service.state import (
    ROLE_NAMES,
)
from diloco.v1 import coordinator_pb2 as pb


class StatusRPCs(ServiceBase):
    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        self.wire.unary_in("finish", request)
        self._set_run_state("finishing", request.reason or "asked to finish")  # wakes the merger
        reply = pb.FinishReply(run_state=self._state_pb())
        self.wire.add_out("finish", reply)
        return reply

    @staticmethod
    def _data_worker_rates(worker_id: str, counters: dict[str, float]) -> dict[str, Any]:
        tokens = int(counters.get(f"data_tokens.{worker_id}", 0))
        seconds = float(counters.get(f"data_seconds.{worker_id}", 0.0))
        return {
            "tokens_prepared": tokens,
            "prepare_seconds": round(seconds, 3),
            # While working on chunks (read, tokenize, pack, compress, write): one process's speed.
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        }

    @staticmethod
    def _last_push(push: tuple[float, int, int], now: float, versions: list[int]) -> dict[str, Any]:
        """How long ago a learner last pushed, and how many versions its base was behind its
        fragment's published version now."""
        at, fragment, base = push
        lag = versions[fragment] - base if fragment < len(versions) else None
        return {"last_push_age_s": round(now - at, 3), "version_lag": lag}

    def status_detail(self) -> dict[str, Any]:
        summary = self.ledger.summary()
        now = self.clock()
        ttl = self.config.coordinator.lease_ttl_s
        workers = []
        pushed = self.ledger.last_pushes()
        versions = [f.published_version for f in self.fragments]
        with self.cond:  # appended to by pushes under the lock
            watched = {wid: {**w.figures(), "suspect": w.suspect} for wid, w in self.pusher_watch.items()}
        for w in self.ledger.workers():
            stats = json.loads(w["stats"])
            workers.append(
                {
                    "worker_id": w["id"],
                    "role": w["role"],
                    "host": w["host"],
                    "state": w["state"],
                    "last_seen_s": round(now - w["last_seen"], 3),
                    "alive": w["state"] == "active" and now - w["last_seen"] < ttl,
                    **stats,
                    **(self._data_worker_rates(w["id"], summary["counters"]) if w["role"] == "data" else {}),
                    **(self._last_push(pushed[w["id"]], now, versions) if w["id"] in pushed else {}),
                    **watched.get(w["id"], {}),
                }
            )
        wire_in, wire_out = self.wire.totals()
        counters = summary.pop("counters")
        first_loss = self.ledger.get_meta("first_loss")
        return {
            **summary,
            "run_state": self.run_state,
            # Seconds since a merge was last saved (this coordinator's life; None: none yet): a run
            # that trains but no longer merges shows here first.
            "last_merge_s": None if self.published_at is None else round(now - self.published_at, 1),
            # Merges that cannot be saved (a full disk): for how long, and the store's error.
            "publish_failing": None
            if self.publish_failing is None
            else {"seconds": round(now - self.publish_failing[0], 1), "error": self.publish_failing[1]},
            # What the counts count: tokens of packed text, or samples of a preprocess's data.
            "unit": self.config.data.unit,
            "coordinator_epoch": self.epoch,
            "fragment_versions": [f.published_version for f in self.fragments],
            "tokens_merged": int(counters.get("tokens_merged", 0)),
            "tokens_pushed": int(counters.get("tokens_trained", 0)),
            # Heartbeats are current while learners run; pushes are exact once they have left.
            "tokens_trained": max(self._tokens_reported(), int(counters.get("tokens_trained", 0))),
            # Time in inner steps over every life of every learner (heartbeats; earlier lives kept).
            "learner_busy_seconds": round(
                counters.get("busy_seconds_by_earlier_lives", 0.0)
                + sum(w.get("busy_seconds", 0.0) for w in workers if w["role"] == "compute"),
                3,
            ),
            # Of it, the steps whose work survived: carried by pushes or saved on local disk.
            "learner_kept_busy_seconds": round(
                counters.get("kept_busy_seconds_by_earlier_lives", 0.0)
                + sum(w.get("kept_busy_seconds", 0.0) for w in workers if w["role"] == "compute"),
                3,
            ),
            "pushes_received": int(counters.get("pushes_received", 0)),
            "pushes_refused": int(counters.get("pushes_refused", 0)),
            # Taken for their rows only (own fresh rows, no credit left): rows kept, delta not merged.
            "pushes_rows_only": int(counters.get("pushes_rows_only", 0)),
            # Taken, but pulled toward the fragment's mean step (sync.center_clip).
            "pushes_center_clipped": int(counters.get("pushes_center_clipped", 0)),
            "record_stats": {
                k.split(".", 1)[1]: int(v) for k, v in counters.items() if k.startswith("records.")
            },
            "first_loss": float(first_loss) if first_loss else None,
            # The learners alive now; once all have left, what each reported last.
            "train_metrics": mean_metrics(
                [w.get("train_metrics") or {} for w in workers if w["role"] == "compute" and w["alive"]]
                or [w.get("train_metrics") or {} for w in workers if w["role"] == "compute"]
            ),
            "last_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "wire_bytes_in": wire_in,
            "wire_bytes_out": wire_out,
            "wire_by_rpc": self.wire.by_kind(),
            "wire_by_role": self.wire.by_role(),
            # Bounded, so Status fits its message limit whatever joined (a week of restarts,
            # or fake workers): the live ones first, then the most recently seen.
            "workers": (shown := shown_workers(workers, STATUS_MAX_WORKERS)),
            # Learners whose last pushes look hostile or broken (pusher_watch), and why.
            "suspect_learners": {w["worker_id"]: w["suspect"] for w in shown if w.get("suspect")},
            "suspects_refused": self.config.sync.refuse_suspects,  # their pushes refused meanwhile
            "workers_total": len(workers),
            "uptime_s": round(now - self.started_at, 3),
            "security": self.security_mode,
            # Under --tls-crl: how many certificates it revokes now (None: no list).
            "certificates_revoked": None if self.revocations is None else len(self.revocations.serials),
            "calls_refused": int(counters.get("calls_refused", 0)) + self.refusals_unsaved,
            # One push and one learner pull on the wire, on average, and how many (every life's).
            "transfers": self.metrics.transfers(),
            # The held-out loss of published models over the run (the evaluator's reports).
            "evals": self.ledger.evals(last=STATUS_EVALS),
            "eval_split": self.ledger.eval_split(),
            # Where an evaluator recomputes a BatchNorm model's statistics (eval.recalibrate_batches);
            # a model without running statistics (none averaged) asks nothing of the ledger.
            "recalibration_split": self.ledger.recalibration_split(
                self.config.eval.recalibrate_batches * self.config.train.batch_size if self.averaged else 0
            ),
        }

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self.wire.unary_in("status", request)
        d = self.status_detail()
        limit = self.config.coordinator.max_message_bytes // 2  # of the client's, which may be smaller
        while True:  # the worker list halved until the reply fits (bounded: 10 halvings at most)
            reply = self._status_reply(d)
            if reply.ByteSize() <= limit or not d["workers"]:
                break
            d["workers"] = shown_workers(d["workers"], len(d["workers"]) // 2)
        self.wire.add_out("status", reply)
        return reply

    def _status_reply(self, d: dict[str, Any]) -> pb.StatusReply:
        return pb.StatusReply(
            run_state=self._state_pb(),
            coordinator_epoch=self.epoch,
            chunks_total=d["chunks_total"],
            chunks_done=d["chunks_done"],
            chunks_quarantined=d["chunks_quarantined"],
            shards_total=d["shards_total"],
            shards_consumed=d["shards_consumed"],
            tokens_prepared=d["tokens_prepared"],
            tokens_merged=d["tokens_merged"],
            tokens_trained=d["tokens_trained"],
            rounds=d["rounds"],
            fragment_versions=d["fragment_versions"],
            last_loss=d["last_loss"] or 0.0,
            first_loss=d["first_loss"] or 0.0,
            wire_bytes_in=d["wire_bytes_in"],
            wire_bytes_out=d["wire_bytes_out"],
            pushes_accepted=d["pushes_received"],
            pushes_refused=d["pushes_refused"],
            workers=[
                pb.WorkerStatus(
                    worker_id=w["worker_id"],
                    role=next(k for k, v in ROLE_NAMES.items() if v == w["role"]),
                    host=w["host"],
                    last_seen_s=w["last_seen_s"],
                    alive=w["alive"],
                    inner_steps=int(w.get("inner_steps", 0)),
                    tokens_trained=int(w.get("tokens_trained", 0)),
                    last_loss=float(w.get("last_loss", 0.0)),
                    busy_seconds=float(w.get("busy_seconds", 0.0)),
                    wall_seconds=float(w.get("wall_seconds", 0.0)),
                )
                for w in d["workers"]
            ],
            detail_json=json.dumps(d),
        )


# Workers a status lists at most (each up to ~4 KB of stats: metric names are bounded).
STATUS_MAX_WORKERS = 512


def shown_workers(workers: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` of the workers: the live ones first, then by how recently each was seen;
    in their order of joining."""
    if len(workers) <= limit:
        return workers
    order = sorted(range(len(workers)), key=lambda i: (not workers[i]["alive"], workers[i]["last_seen_s"]))
    return [workers[i] for i in sorted(order[:limit])]


def mean_metrics(per_learner: list[dict[str, float]]) -> dict[str, float]:
    """The learners' training metrics, each averaged over the learners that report it."""
    names = sorted({name for m in per_learner for name in m})
    return {n: sum(m[n] for m in per_learner if n in m) / sum(n in m for m in per_learner) for n in names}
