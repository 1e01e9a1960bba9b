"""The data workers' RPCs: lease, complete and fail raw chunks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NoReturn

import grpc

from diloco import store
from diloco.coordinator import limits
from diloco.coordinator.lease_claims import Refusal, attempt_of, attempt_shard_uri
from diloco.coordinator.ledger import ChunkLease, NoLease
from diloco.coordinator.log_text import loggable
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    log,
)
from diloco.data.preprocess import schema_difference
from diloco.data.shard import completion_problem
from diloco.store import StoreError
from diloco.v1 import coordinator_pb2 as pb

# A data worker told to wait asks again after about half the time between recent chunk completions,
# within these bounds. Held back by data.max_ready_shards, its wait ends when a learner takes a
# shard; small samples' shards go in a fraction of a second (digits: 665 rows in ~0.1 s of steps),
# and a fixed 1 s kept the learners waiting 69% of the time. Large text shards complete seconds
# apart: their data workers still ask once a second.
MIN_RETRY_S = 0.05
MAX_RETRY_S = 1.0


def retry_after_s(done_at: Sequence[float], now: float) -> float:
    """How long a data worker with nothing to lease waits: half the mean interval of the last
    completions `done_at` (oldest first), or of the time since the last one when that is longer
    (nothing completing: back off), within [MIN_RETRY_S, MAX_RETRY_S]."""
    if len(done_at) < 2:
        return MAX_RETRY_S
    interval = max((done_at[-1] - done_at[0]) / (len(done_at) - 1), now - done_at[-1])
    return min(MAX_RETRY_S, max(MIN_RETRY_S, interval / 2))


class ChunkRPCs(ServiceBase):
    def _wait_reply(self) -> pb.LeaseChunkReply:
        wait = retry_after_s(list(self.chunk_completions), self.clock())
        return pb.LeaseChunkReply(retry_after_s=wait, run_state=self._state_pb())

    def LeaseChunk(self, request: pb.LeaseChunkRequest, context: grpc.ServicerContext) -> pb.LeaseChunkReply:
        self.wire.unary_in("lease_chunk", request)
        self._require_worker(request.worker_id, context, "LeaseChunk")
        ttl = self.config.coordinator.lease_ttl_s
        if self.run_state != "running":
            reply = pb.LeaseChunkReply(done=True, run_state=self._state_pb())
        elif self._holds_enough(request.worker_id):
            reply = pb.LeaseChunkReply(retry_after_s=MAX_RETRY_S, run_state=self._state_pb())
        else:
            lease = self.ledger.lease_chunk(
                request.worker_id,
                ttl,
                self.config.coordinator.max_chunk_attempts,
                self.config.data.max_ready_shards,
                self.config.data.deal,
            )
            if isinstance(lease, ChunkLease):
                shard_uri = attempt_shard_uri(self.shard_root, lease.chunk_id, lease.attempt)
                reply = pb.LeaseChunkReply(
                    chunk_id=lease.chunk_id,
                    split=lease.spec.split,
                    shard_uri=shard_uri,
                    lease_ttl_s=ttl,
                    segments=[
                        pb.Segment(
                            uri=s.uri,
                            start=s.start,
                            end=s.end,
                            file_end=s.file_end,
                            unit=s.unit,
                            nbytes=s.nbytes,
                        )
                        for s in lease.spec.segments
                    ],
                    run_state=self._state_pb(),
                )
            elif lease is NoLease.WAIT:
                reply = self._wait_reply()
            else:
                reply = pb.LeaseChunkReply(done=True, run_state=self._state_pb())
        self.wire.add_out("lease_chunk", reply)
        return reply

    def CompleteChunk(
        self, request: pb.CompleteChunkRequest, context: grpc.ServicerContext
    ) -> pb.CompleteChunkReply:
        self.wire.unary_in("complete_chunk", request)
        self._require_worker(request.worker_id, context, "CompleteChunk")
        if not request.completion_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "completion_id is required")
        if not store.uri_under(request.shard_uri, self.shard_root):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shard {limits.cut_text(request.shard_uri, 300)!r} is outside the shard store",
            )
        if problem := limits.numbers_problem(
            (f, float(getattr(request, f)))
            for f in ("rows", "tokens", "bytes_in", "shard_bytes", "dropped_tokens", "seconds")
        ):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.rows and request.tokens % request.rows:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be a whole number of rows")
        if any(
            limits.id_problem(k, "a record stat") or not 0 <= v <= limits.MAX_COUNT
            for k, v in request.record_stats.items()
        ):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "record_stats: short names, counts in [0, 2^50]")
        # Whose completion it is, before its file is opened: only the worker that leased this
        # attempt of the chunk, and only for the file that attempt was told to write.
        attempt = attempt_of(self.shard_root, request.chunk_id, request.shard_uri)
        if attempt is None:
            self._refuse_completion(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shard {limits.cut_text(request.shard_uri, 300)!r} is not a file a lease of chunk "
                f"{request.chunk_id} names",
            )
        verdict = self.ledger.completion_verdict(
            request.worker_id, request.chunk_id, request.completion_id, attempt, request.shard_uri
        )
        if verdict is not None and verdict.refusal is Refusal.DENIED:
            self._refuse_completion(context, grpc.StatusCode.PERMISSION_DENIED, verdict.reason)
        if verdict is not None and not verdict.taken:  # its lease is over: its file is surplus
            self.ledger.bump("chunk_completions_refused")
            return self._completion_reply(
                request, pb.CompleteChunkReply(accepted=False, reason=verdict.reason)
            )
        if verdict is not None and (reply := self._file_refusal(request)) is not None:
            return self._completion_reply(request, reply)
        done = self.ledger.complete_chunk(
            request.worker_id,
            request.chunk_id,
            request.completion_id,
            request.shard_uri,
            request.rows,
            request.tokens,
            request.checksum,
            request.shard_bytes,
            dict(request.record_stats),
            attempt=attempt,
        )
        if done.accepted and done.reason != "already recorded":  # a retried completion counts once
            # Each data worker's throughput, for status and summary.json: tokens it wrote into
            # recorded shards, and the seconds it spent on those chunks.
            self.ledger.bump(f"data_tokens.{request.worker_id}", request.tokens)
            self.ledger.bump(f"data_seconds.{request.worker_id}", request.seconds)
            self.chunk_completions.append(self.clock())
        log.info(
            "chunk %d complete worker=%s accepted=%s (%s) rows=%d",
            request.chunk_id,
            request.worker_id,
            done.accepted,
            done.reason,
            request.rows,
        )
        reply = pb.CompleteChunkReply(accepted=done.accepted, reason=done.reason, shard_id=done.shard_id)
        self.wire.add_out("complete_chunk", reply)
        return reply

    def _refuse_completion(self, context: grpc.ServicerContext, code: grpc.StatusCode, why: str) -> NoReturn:
        self.ledger.bump("chunk_completions_refused")
        self.caller_refused("CompleteChunk", why, context.peer())
        context.abort(code, why)

    def _completion_reply(
        self, request: pb.CompleteChunkRequest, reply: pb.CompleteChunkReply
    ) -> pb.CompleteChunkReply:
        log.warning(
            "chunk %d from %s not taken: %s", request.chunk_id, request.worker_id, loggable(reply.reason)
        )
        self.wire.add_out("complete_chunk", reply)
        return reply

    def _file_refusal(self, request: pb.CompleteChunkRequest) -> pb.CompleteChunkReply | None:
        """Why the lease holder's shard is refused (its columns are not the run's, or its file is
        not what it reports), as the reply; None: it is taken."""
        if request.schema and (refusal := self._schema_refusal(request.schema)):
            return pb.CompleteChunkReply(accepted=False, reason=refusal, wrong_schema=True)
        if self.config.coordinator.verify_shards and (problem := self._shard_problem(request)):
            # A failed attempt of the chunk (it goes back to the pool, or to quarantine), and the
            # worker removes its file: no learner ever reads a shard its completion misdescribes.
            self.ledger.fail_chunk(
                request.worker_id,
                request.chunk_id,
                f"shard refused: {problem}",
                self.config.coordinator.max_chunk_attempts,
            )
            return pb.CompleteChunkReply(
                accepted=False, reason=f"the shard file is not what was reported: {problem}"
            )
        return None

    def _shard_problem(self, request: pb.CompleteChunkRequest) -> str | None:
        """Why the shard file is not the one the completion reports (a regular file of its bytes,
        then its rows, tokens and checksum): never more than the reported bytes are read."""
        if request.shard_bytes > limits.MAX_SHARD_BYTES:
            return f"{request.shard_bytes} bytes; {limits.MAX_SHARD_BYTES} at most"
        try:
            data = store.read_exact(request.shard_uri, request.shard_bytes)
        except StoreError as e:
            return limits.cut_text(str(e), 300)
        except OSError as e:
            return limits.cut_text(f"unreadable: {e}", 300)
        return completion_problem(data, request.rows, request.tokens, request.checksum)

    def _schema_refusal(self, schema_json: str) -> str:
        """Why a shard's columns are not the run's (the first recorded shard's), or ""."""
        try:
            got = json.loads(schema_json)
        except ValueError:
            return "the shard's schema is not JSON"
        recorded = json.loads(self.ledger.first_meta("schema", json.dumps(got, sort_keys=True)))
        if got == recorded:
            return ""
        return f"its columns are not the run's ({schema_difference(recorded, got)}): is data.preprocess the same on every data worker?"

    def FailChunk(self, request: pb.FailChunkRequest, context: grpc.ServicerContext) -> pb.FailChunkReply:
        self.wire.unary_in("fail_chunk", request)
        self._require_worker(request.worker_id, context, "FailChunk")
        request.error = limits.cut_text(request.error)
        quarantined = self.ledger.fail_chunk(
            request.worker_id, request.chunk_id, request.error, self.config.coordinator.max_chunk_attempts
        )
        log.warning(
            "chunk %d failed worker=%s quarantined=%s: %s",
            request.chunk_id,
            request.worker_id,
            quarantined,
            loggable(request.error.splitlines()[0]) if request.error else "",
        )
        self.events.record(
            "chunk_failed", chunk=request.chunk_id, worker_id=request.worker_id, quarantined=quarantined,
            error=request.error.splitlines()[0][:200] if request.error else "",
        )  # fmt: skip
        reply = pb.FailChunkReply(quarantined=quarantined)
        self.wire.add_out("fail_chunk", reply)
        return reply
