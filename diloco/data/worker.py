"""The data worker: lease a raw chunk, make a shard of it (tokenize and pack, or the user's
preprocess: diloco.data.makers), report it. Repeat.

Stateless: everything it needs comes with the lease and the config handed over at join, so any
number of them can run anywhere that reaches the store and the coordinator. It exits 0 when the
coordinator says there is nothing left to do, and on SIGTERM gives its lease back first.
"""

from __future__ import annotations

import logging
import os
import re
import sysconfig
import threading
import time
import traceback
import uuid

from diloco import store
from diloco.client import WORKER_OUTAGE_TOLERANCE_S, CoordinatorClient
from diloco.corpus import STDLIB
from diloco.data.chunks import UNIT_ROW_GROUPS, ChunkSpec, Segment
from diloco.data.fields import MissingTextField
from diloco.data.makers import ShardMaker, shard_maker
from diloco.errors import DilocoError
from diloco.plugins import refuse_unallowed
from diloco.role import heartbeat_thread, refusing
from diloco.security.transport import Security
from diloco.tokenizer import load_checked_tokenizer
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.data")


class DataWorker:
    def __init__(
        self,
        address: str,
        stop: threading.Event | None = None,
        connect_timeout_s: float = 60.0,
        worker_id: str | None = None,
        security: Security | None = None,
        read_roots: tuple[str, ...] = (),
    ):
        self.connect_timeout_s = connect_timeout_s
        # Where this machine lets the coordinator point it (--read-root); none: under the dataset
        # the coordinator named at join (dataset_roots), never anywhere else.
        self.read_roots = read_roots
        self.client = CoordinatorClient(
            address,
            pb.ROLE_DATA,
            retry_deadline_s=WORKER_OUTAGE_TOLERANCE_S,
            worker_id=worker_id,
            security=security,
        )
        self.stop = stop or threading.Event()
        self.current_chunk: int | None = None
        self.chunks_done = 0
        self.tokens_out = 0  # a preprocess's shards count samples here (self.unit)
        self.unit = "tokens"
        self.busy_s = 0.0
        self.started = time.monotonic()

    def _heartbeat(self) -> None:
        held = [self.current_chunk] if self.current_chunk else []
        request = pb.HeartbeatRequest(
            chunk_leases=held, tokens_trained=0, busy_seconds=self.busy_s,
            wall_seconds=time.monotonic() - self.started,
        )  # fmt: skip
        self.client.heartbeat(request)

    def run(self) -> int:
        reply = self.client.join(self.connect_timeout_s)
        config = self.client.config
        assert config is not None
        self.unit = config.data.unit  # as the coordinator counts them
        with refusing(self.client, log):
            refuse_unallowed(config.data.preprocess, "data.preprocess", "--preprocess")
            if not config.data.store:  # the shard root: without one, nothing bounds where we write
                raise DilocoError(
                    "the coordinator named no data.store: this worker writes shards only under one"
                )
            if not self.read_roots:
                self.read_roots = dataset_roots(config.data.dataset)
                log.info("reading raw data only under %s (--read-root to choose)", self.read_roots[0])
            tokenizer = load_checked_tokenizer(config.data.tokenizer, reply.tokenizer_hash)
            maker = shard_maker(config, tokenizer)
        heartbeats = heartbeat_thread(self._heartbeat, reply.heartbeat_s, self.stop, log)
        try:
            while not self.stop.is_set():
                lease = self.client.lease_chunk()
                if lease.done:
                    log.info(
                        "nothing left to do (%d chunks, %d %s)", self.chunks_done, self.tokens_out, self.unit
                    )
                    break
                if lease.retry_after_s > 0:
                    self.stop.wait(lease.retry_after_s)
                    continue
                self._process(lease, maker)
        finally:
            self.stop.set()
            self.client.leave("finished" if self.current_chunk is None else "stopping")
            self.client.close()
            heartbeats.join(5.0)  # not inside gRPC at interpreter exit
        return 0

    def _lease_problem(self, lease: pb.LeaseChunkReply) -> str:
        """Why this worker will not do what a lease asks ("" when it will): a shard written (and,
        on a refused completion, deleted) outside the run's shard store, or raw data read outside
        this worker's read roots (--read-root, or the dataset named at join)."""
        root = self.client.config.data.store if self.client.config else ""
        if not root or not store.uri_under(lease.shard_uri, store.shard_root(root)):
            return f"shard URI {lease.shard_uri!r} is outside the run's shard store"
        outside = [s.uri for s in lease.segments if not store.uri_within(s.uri, self.read_roots)]
        if outside or not self.read_roots:
            return f"segment {(outside or [''])[0]!r} is outside this worker's read roots (--read-root)"
        return ""

    def _process(self, lease: pb.LeaseChunkReply, maker: ShardMaker) -> None:
        self.current_chunk = lease.chunk_id
        started = time.monotonic()
        chunk = ChunkSpec(
            index=lease.chunk_id - 1,
            segments=tuple(
                Segment(s.uri, s.start, s.end, s.file_end, UNIT_ROW_GROUPS, s.nbytes)
                if s.unit == UNIT_ROW_GROUPS
                else Segment(s.uri, s.start, s.end, s.file_end)
                for s in lease.segments
            ),
            split=lease.split,
        )
        if problem := self._lease_problem(lease):
            log.error("chunk %d: %s", lease.chunk_id, problem)
            self.client.fail_chunk(lease.chunk_id, problem)
            self.current_chunk = None
            return
        try:
            made = maker.make(chunk, lease.shard_uri)
        except MissingTextField as e:  # the data's own fault: one line, no traceback
            log.error("chunk %d failed: %s", lease.chunk_id, e)
            self.client.fail_chunk(lease.chunk_id, str(e))
            self.current_chunk = None
            return
        except Exception as e:  # any failure of this chunk is reported, never fatal to the worker
            log.warning("chunk %d failed: %s", lease.chunk_id, e)
            self.client.fail_chunk(
                lease.chunk_id, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
            )
            self.current_chunk = None
            return
        seconds, info = time.monotonic() - started, made.info
        done = self.client.complete_chunk(
            pb.CompleteChunkRequest(
                chunk_id=lease.chunk_id,
                completion_id=uuid.uuid4().hex,
                shard_uri=info.uri,
                rows=info.rows,
                tokens=info.tokens,
                checksum=info.checksum,
                bytes_in=made.bytes_in,
                shard_bytes=info.nbytes,
                dropped_tokens=made.dropped_tokens,
                record_stats={k: v for k, v in made.stats.as_dict().items() if v},
                seconds=seconds,
                schema=made.schema,
            ),
        )
        self.current_chunk = None
        self.busy_s += seconds
        if done.wrong_schema:  # our preprocess is not the run's: a failed attempt, not surplus
            log.error("chunk %d: %s", lease.chunk_id, done.reason)
            store.remove(info.uri)
            self.client.fail_chunk(lease.chunk_id, f"the coordinator refused the shard: {done.reason}")
            return
        if not done.accepted:
            # Another worker's shard for this chunk was recorded first: ours is surplus.
            log.info("chunk %d: completion refused (%s); removing %s", lease.chunk_id, done.reason, info.uri)
            store.remove(info.uri)
            return
        self.chunks_done += 1
        self.tokens_out += info.tokens
        log.info(
            "chunk %d -> shard %d rows=%d %s=%d in %.2fs (%.0f %s/s)",
            lease.chunk_id,
            done.shard_id,
            info.rows,
            self.unit,
            info.tokens,
            seconds,
            info.tokens / max(seconds, 1e-9),
            self.unit,
        )


def dataset_roots(dataset: str) -> tuple[str, ...]:
    """Where a worker without --read-root reads: under the dataset the coordinator named at join
    (a directory, file or prefix; a glob's fixed part; "stdlib": the stdlib's directory). It keeps a
    lease from reaching beyond the run's data; only --read-root also bounds what the dataset is."""
    if dataset == STDLIB:
        return (sysconfig.get_paths()["stdlib"],)
    fixed = re.split(r"[*?\[]", dataset, maxsplit=1)[0]
    if fixed != dataset:  # a glob: the directory its wildcards start in
        fixed = fixed.rsplit("/", 1)[0] if "/" in fixed else "."
    if "://" in fixed:
        return (fixed,)
    return tuple(dict.fromkeys((fixed, os.path.abspath(fixed))))


def run_data_worker(
    address: str,
    stop: threading.Event | None = None,
    connect_timeout_s: float = 60.0,
    worker_id: str | None = None,
    metrics_port: int | None = None,
    read_roots: tuple[str, ...] = (),
) -> int:
    worker = DataWorker(address, stop, connect_timeout_s, worker_id, read_roots=read_roots)
    if metrics_port is None:
        return worker.run()
    from diloco.observe.worker_metrics import serve_worker_metrics

    def snapshot() -> dict[str, float]:
        return {
            "chunks_done": worker.chunks_done,
            "tokens_prepared": worker.tokens_out,
            "busy_seconds": worker.busy_s,
        }

    server = serve_worker_metrics(
        "data", metrics_port, "127.0.0.1", snapshot, lambda: worker.client.worker_id
    )
    log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)
    try:
        return worker.run()
    finally:
        server.shutdown()
