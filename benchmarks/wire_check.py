"""The coordinator's wire counts next to the bytes a TCP proxy really carries.

    python benchmarks/wire_check.py --pushes 20

A learner-shaped client talks to a real coordinator through a byte-counting TCP proxy on
127.0.0.1: join, init, pulls, pushes (int8 deltas), heartbeats, leave. The coordinator counts
what it saw for the compute role (protobuf + gRPC prefix + HTTP/2 frame headers + a per-call
estimate of HEADERS and trailers); the proxy counts every byte of the TCP stream (HTTP/2
settings, pings, window updates included). Printed: both, and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._local import coordinator_with_shards, initial_parameters  # noqa: E402
from diloco.client import CoordinatorClient  # noqa: E402
from diloco.v1 import coordinator_pb2 as pb  # noqa: E402
from diloco.wire import codecs  # noqa: E402


class CountingProxy:
    """Forwards TCP connections from a local port to `target`, counting bytes each way."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = 0  # client -> server
        self.down = 0  # server -> client
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, "down"), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                with self._lock:
                    if direction == "up":
                        self.up += len(data)
                    else:
                        self.down += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=5)
        self._listener.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pushes", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "wire_check.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="diloco_wire_") as tmp:
        running = coordinator_with_shards(Path(tmp), {
            "model.kwargs.n_layer": 2, "model.kwargs.n_embd": 64, "model.kwargs.n_head": 2, "sync.fragments": 1,
            "sync.quorum": 1, "sync.grace_factor": 0.0, "sync.codec": "int8", "sync.pull_codec": "int8",
            "sync.max_staleness": 1_000_000,
        })  # fmt: skip
        proxy = CountingProxy(running.port)
        client = CoordinatorClient(f"127.0.0.1:{proxy.port}", pb.ROLE_COMPUTE)
        client.join()
        params = initial_parameters(client)
        client.init_parameters(params)
        version = 0
        shard, row = client.lease_shard(), 0  # each push names a row of it it trained (as learners do)
        for i in range(args.pushes):
            if row >= shard.rows:
                shard, row = client.lease_shard(), 0
            delta = {n: torch.randn_like(t) * 1e-3 for n, t in params.items()}
            blobs = {
                n: torch.frombuffer(bytearray(codecs.encode(t, "int8")), dtype=torch.uint8)
                for n, t in delta.items()
            }
            header = pb.TensorHeader(fragment=0, version=version, inner_steps=10, tokens=1000,
                                     codec="int8", push_id=uuid.uuid4().hex)  # fmt: skip
            header.spans.add(shard_id=shard.shard_id, row_start=row, row_end=row + 1)
            row += 1
            reply = client.push(header, blobs)
            got = client.pull([0], [version], wait_s=10, wait_above=[reply.version])
            version = got[-1][0].version if got else version
            client.call("Heartbeat", pb.HeartbeatRequest(inner_steps=i))
        client.leave("done")
        client.close()
        time.sleep(0.5)  # the last frames through the proxy
        counted = running.service.wire.by_role().get("compute", {})
        proxy.close()
        running.stop()
    result = {
        "pushes": args.pushes,
        "proxy_bytes": proxy.up + proxy.down,
        "proxy_up": proxy.up,
        "proxy_down": proxy.down,
        "counted_bytes": counted.get("received", 0) + counted.get("sent", 0),
        "counted_up": counted.get("received", 0),
        "counted_down": counted.get("sent", 0),
    }
    result["counted_over_proxy"] = result["counted_bytes"] / max(1, result["proxy_bytes"])
    print(f"{'':<12}{'proxy (TCP)':>14}{'counted':>14}")
    for k in ("up", "down"):
        print(f"{k:<12}{result['proxy_' + k]:>14,}{result['counted_' + k]:>14,}")
    print(f"counted / proxy: {result['counted_over_proxy']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
