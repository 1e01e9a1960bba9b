"""The pushing side of benchmarks/ingest.py and ingest_profile.py: M threads in a process of their
own, started once per arm, that stream one fragment's serialized delta to a raw gRPC handler or to
a real coordinator (each learner on a connection of its own, with `tls` on its own certificate),
and one turn's measurement (bytes, seconds with merges drained, the server's and pushers' CPU)."""

from __future__ import annotations

import multiprocessing as mp
import resource
import threading
import time
import uuid
from typing import NamedTuple

import torch

from benchmarks._local import span_of
from diloco.config import RunConfig
from diloco.coordinator.server import grpc_options
from diloco.security.certs import TlsFiles
from diloco.security.transport import Security, client_channel
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import stream_tensors


def drive(send_one, learners: int, seconds: float) -> tuple[int, float]:
    """M threads call send_one(thread index) in a loop for `seconds`; returns (bytes sent, elapsed)."""
    total = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    failed: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            while time.monotonic() < stop:
                n = send_one(i)
                with lock:
                    total[0] += n
        except BaseException as e:  # a thread's error would end it silently: one pusher fewer
            failed.append(e)

    started = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(learners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return total[0], time.monotonic() - started


def push_messages(shapes: dict[str, tuple[int, ...]], piece: int) -> list[bytes]:
    """A fragment's delta as serialized stream messages: the header first, then the pieces."""
    gen = torch.Generator().manual_seed(0)
    delta = {n: torch.randn(shape, generator=gen) * 1e-4 for n, shape in shapes.items()}
    header = pb.TensorHeader(fragment=0, version=0, inner_steps=1, tokens=129)
    return [m.SerializeToString() for m in stream_tensors(header, delta, piece)]


def _pusher_child(
    address, method, worker_ids, shapes, cfg_json, learners, commands, out, tls=None, rows=None
) -> None:
    """The pushing process: connects once, then runs one turn of `seconds` per command (None: done)."""
    cfg = RunConfig.from_json(cfg_json)
    messages = push_messages(shapes, cfg.coordinator.stream_chunk_bytes)
    push_bytes = sum(len(m) for m in messages)
    raw_tls = (tls or {}).get("raw")
    channel = None  # the raw arms' one connection; the ingest arms' learners have their own
    if not worker_ids:
        channel = client_channel(
            address, Security(tls=TlsFiles(*raw_tls) if raw_tls else None), grpc_options(cfg)
        )
    # Each learner on a connection of its own, as learner processes are (with `tls`, on its own
    # certificate's channel: the coordinator checks the names), in both ingest arms alike. A local
    # subchannel pool each: gRPC shares one connection among a process's equal channels otherwise.
    own_options = [*grpc_options(cfg), ("grpc.use_local_subchannel_pool", 1)]
    own = [
        client_channel(address, Security(tls=TlsFiles(*tls[w]) if tls else None), own_options)
        for w in worker_ids
    ]
    calls = [c.stream_unary(method, response_deserializer=pb.PushReply.FromString) for c in own]
    if channel is not None:  # the raw server: the very same bytes, nothing to say about them
        call = channel.stream_unary(method)

        def send_one(i: int) -> int:
            call(iter(messages))
            return push_bytes
    else:
        template = pb.TensorStreamMessage.FromString(messages[0])

        def send_one(i: int) -> int:
            header = pb.TensorStreamMessage()
            header.header.CopyFrom(template.header)
            header.header.push_id = uuid.uuid4().hex
            header.header.worker_id = worker_ids[i]
            shard, row = span_of(rows[worker_ids[i]], worker_ids[i])
            header.header.spans.add(shard_id=shard, row_start=row, row_end=row + 1)
            reply = calls[i](iter([header.SerializeToString(), *messages[1:]]), timeout=120)
            assert reply.accepted, reply.reason
            return push_bytes

    while (seconds := commands.get()) is not None:
        cpu0 = process_cpu_s()
        sent, elapsed = drive(send_one, learners, seconds)
        out.put(Turn(sent, elapsed, push_bytes, process_cpu_s() - cpu0))
    for c in (channel, *own):
        if c is not None:
            c.close()


class Turn(NamedTuple):
    """One turn of the pushing process: bytes sent, seconds it took, bytes per push, its CPU seconds."""

    sent: int
    seconds: float
    push_bytes: int
    cpu_s: float


class Measured(NamedTuple):
    """One arm's turn as measured: bytes, seconds (merges drained), the server's and the pushers' CPU s."""

    sent: int
    seconds: float
    server_cpu_s: float
    pusher_cpu_s: float


class Pusher:
    """M pushing threads in a process of their own (the learners are other processes, as in a real
    job), started once per arm and kept across its turns: a turn pays no process start or torch
    import (seconds each with a CUDA build) and no handshakes, as a learner's channel is kept.
    `tls`: each worker id's certificate, key and CA files (mutual TLS); none, plaintext."""

    def __init__(self, address: str, method: str, worker_ids: list[str], shapes: dict[str, tuple[int, ...]],
                 cfg: RunConfig, learners: int, tls: dict[str, tuple[str, str, str]] | None = None,
                 rows: dict[str, list[tuple[int, int]]] | None = None):  # fmt: skip
        ctx = mp.get_context("spawn")
        self.push_bytes = 0  # known after the first turn
        self.commands, self.out = ctx.Queue(), ctx.Queue()
        self.child = ctx.Process(
            target=_pusher_child,
            args=(
                address,
                method,
                worker_ids,
                shapes,
                cfg.to_json(),
                learners,
                self.commands,
                self.out,
                tls,
                rows,
            ),
            daemon=True,
        )
        self.child.start()

    def turn(self, seconds: float) -> Turn:
        """One turn of pushing for `seconds`."""
        self.commands.put(seconds)
        turn = self.out.get(timeout=seconds + 300)
        self.push_bytes = turn.push_bytes  # one push's bytes, as the pushing process made them
        return turn

    def close(self) -> None:
        self.commands.put(None)
        self.child.join(30)
        if self.child.is_alive():
            self.child.kill()


def process_cpu_s() -> float:
    """CPU seconds (user + system) of this process: in the benchmark's own, the server side of
    every arm; in a pushing process, its pushes."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ingest_turn(running, pusher: Pusher, seconds: float) -> Measured:
    """One turn of pushes to a real coordinator, its merges drained (`running` None: to a raw
    handler, nothing to drain)."""
    cpu0 = process_cpu_s()
    turn = pusher.turn(seconds)
    elapsed = turn.seconds
    if running is not None:  # accepted pushes still waiting for their merge or checkpoint count
        drain_started = time.monotonic()
        assert running.service.wait_published(120), "merges did not catch up"
        elapsed += time.monotonic() - drain_started
    return Measured(turn.sent, elapsed, process_cpu_s() - cpu0, turn.cpu_s)
