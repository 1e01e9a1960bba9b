"""The data worker: lease a raw chunk, tokenize and pack it, write a shard, report it. Repeat.

Stateless: everything it needs comes with the lease and the config handed over at join, so any
number of them can run anywhere that reaches the store and the coordinator. It exits 0 when the
coordinator says there is nothing left to do, and on SIGTERM gives its lease back first.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid

from diloco import store
from diloco.client import WORKER_OUTAGE_TOLERANCE_S, CoordinatorClient
from diloco.config import RunConfig
from diloco.data.chunks import UNIT_ROW_GROUPS, ChunkSpec, Segment
from diloco.data.process import process_chunk
from diloco.data.shard import write_shard
from diloco.role import heartbeat_thread, refusing
from diloco.tokenizer import Tokenizer, load_checked_tokenizer
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.data")


class DataWorker:
    def __init__(
        self,
        address: str,
        stop: threading.Event | None = None,
        connect_timeout_s: float = 60.0,
        worker_id: str | None = None,
    ):
        self.connect_timeout_s = connect_timeout_s
        self.client = CoordinatorClient(
            address, pb.ROLE_DATA, retry_deadline_s=WORKER_OUTAGE_TOLERANCE_S, worker_id=worker_id
        )
        self.stop = stop or threading.Event()
        self.current_chunk: int | None = None
        self.chunks_done = 0
        self.tokens_out = 0
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
        with refusing(self.client, log):
            tokenizer = load_checked_tokenizer(config.data.tokenizer, reply.tokenizer_hash)
        heartbeats = heartbeat_thread(self._heartbeat, reply.heartbeat_s, self.stop, log)
        try:
            while not self.stop.is_set():
                lease = self.client.lease_chunk()
                if lease.done:
                    log.info("nothing left to do (%d chunks, %d tokens)", self.chunks_done, self.tokens_out)
                    break
                if lease.retry_after_s > 0:
                    self.stop.wait(lease.retry_after_s)
                    continue
                self._process(lease, tokenizer, config)
        finally:
            self.stop.set()
            self.client.leave("finished" if self.current_chunk is None else "stopping")
            self.client.close()
            heartbeats.join(5.0)  # not inside gRPC at interpreter exit
        return 0

    def _process(self, lease: pb.LeaseChunkReply, tokenizer: Tokenizer, config: RunConfig) -> None:
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
        try:
            processed = process_chunk(
                chunk, tokenizer, config.model.seq_len, config.data.text_field, config.data.max_record_bytes
            )
            info = write_shard(
                lease.shard_uri,
                processed.rows,
                tokenizer_id=tokenizer.id,
                vocab_size=tokenizer.vocab_size,
                chunk_index=chunk.index,
                meta={"split": lease.split},
            )
        except Exception as e:  # any failure of this chunk is reported, never fatal to the worker
            log.warning("chunk %d failed: %s", lease.chunk_id, e)
            self.client.fail_chunk(
                lease.chunk_id, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
            )
            self.current_chunk = None
            return
        seconds = time.monotonic() - started
        done = self.client.complete_chunk(
            pb.CompleteChunkRequest(
                chunk_id=lease.chunk_id,
                completion_id=uuid.uuid4().hex,
                shard_uri=info.uri,
                rows=info.rows,
                tokens=info.tokens,
                checksum=info.checksum,
                bytes_in=processed.bytes_in,
                shard_bytes=info.nbytes,
                dropped_tokens=processed.dropped_tokens,
                record_stats={k: v for k, v in processed.stats.as_dict().items() if v},
                seconds=seconds,
            ),
        )
        self.current_chunk = None
        self.busy_s += seconds
        if not done.accepted:
            # Another worker's shard for this chunk was recorded first: ours is surplus.
            log.info("chunk %d: completion refused (%s); removing %s", lease.chunk_id, done.reason, info.uri)
            store.remove(info.uri)
            return
        self.chunks_done += 1
        self.tokens_out += info.tokens
        log.info(
            "chunk %d -> shard %d rows=%d tokens=%d in %.2fs (%.0f tokens/s)",
            lease.chunk_id,
            done.shard_id,
            info.rows,
            info.tokens,
            seconds,
            info.tokens / max(seconds, 1e-9),
        )


def run_data_worker(
    address: str,
    stop: threading.Event | None = None,
    connect_timeout_s: float = 60.0,
    worker_id: str | None = None,
) -> int:
    return DataWorker(address, stop, connect_timeout_s, worker_id).run()
