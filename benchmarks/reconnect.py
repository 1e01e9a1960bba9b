"""How soon workers are back after the coordinator restarts: kill -9, restart, first call answered.

    python benchmarks/reconnect.py --restarts 12

A real coordinator (`diloco coordinator`, forked from a warm interpreter as `diloco run` does, so
a restart listens again within a fraction of a second) is killed with SIGKILL and started again
on the same port and workdir, --restarts times. Beside it, two clients in this process call
`Status` over and over through the library's retries (`CoordinatorClient.status`, the same
backoff as a worker's heartbeats, leases and pushes):

- `diloco`: a client as every worker makes it;
- `grpc-defaults`: the same client without `diloco.client.RECONNECT_OPTIONS` (gRPC's own
  reconnect schedule: 1 s before the first new attempt, up to 2 minutes).

Both ride out the same restarts. For each restart: `down`, from the kill to the port accepting
connections again (TCP, probed every 5 ms), and per client `back`, from then to its first answered
call. Printed: mean, median and worst `back` per arm, and their ratio. Results: --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco import client as client_module  # noqa: E402
from diloco.client import CoordinatorClient  # noqa: E402
from diloco.local.procs import ProcessGroup  # noqa: E402
from diloco.v1 import coordinator_pb2 as pb  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.05)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(what: str, check, timeout_s: float, every_s: float = 0.005) -> float:
    """Poll `check` until true; the monotonic time it first was."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(every_s)
    raise TimeoutError(f"{what} within {timeout_s:.0f}s")


class Caller(threading.Thread):
    """Calls Status through the client's retries, back to back; keeps when each was answered."""

    def __init__(self, address: str, reconnect_options: list, stop: threading.Event):
        super().__init__(daemon=True)
        saved = client_module.RECONNECT_OPTIONS
        client_module.RECONNECT_OPTIONS = reconnect_options  # read when the channel is made
        try:
            self.client = CoordinatorClient(address, pb.ROLE_OBSERVER, retry_deadline_s=60)
        finally:
            client_module.RECONNECT_OPTIONS = saved
        self.stop = stop
        self.answered: list[float] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.status(timeout_s=2.0)
            except Exception:  # past the retry deadline, or closed at the end
                continue
            with self.lock:
                self.answered.append(time.monotonic())
            time.sleep(0.01)

    def first_answer_after(self, t: float, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                later = [a for a in self.answered if a > t]
            if later:
                return later[0]
            time.sleep(0.01)
        raise TimeoutError("no answer after the restart")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--restarts", type=int, default=12)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "reconnect.json")
    args = p.parse_args(argv)

    arms = {"diloco": client_module.RECONNECT_OPTIONS, "grpc-defaults": []}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="diloco_reconnect_") as tmp:
        port = free_port()
        group = ProcessGroup(Path(tmp) / "logs", fork=True)
        stop = threading.Event()
        callers: dict[str, Caller] = {}
        try:
            coordinator = group.spawn(
                "coordinator", "coordinator",
                ["coordinator", "--workdir", str(Path(tmp) / "run"), "--dataset", "stdlib", "--port", str(port)],
            )  # fmt: skip
            wait_until("the coordinator to listen", lambda: accepts(port), 120)
            address = f"127.0.0.1:{port}"
            callers = {name: Caller(address, options, stop) for name, options in arms.items()}
            for c in callers.values():
                c.start()
            for c in callers.values():
                c.first_answer_after(0.0, 60)
            for i in range(args.restarts):
                time.sleep(1.0)  # both clients calling at their usual pace
                killed = time.monotonic()
                group.signal(coordinator, signal.SIGKILL)
                assert group.wait([coordinator], 10), "the coordinator did not die"
                coordinator = group.respawn(coordinator)
                up = wait_until("the restarted coordinator to listen", lambda: accepts(port), 60)
                back = {name: c.first_answer_after(up, 60) - up for name, c in callers.items()}
                rows.append(
                    {
                        "restart": i + 1,
                        "down_s": round(up - killed, 3),
                        **{k: round(v, 3) for k, v in back.items()},
                    }
                )
                print(f"restart {i + 1}: down {up - killed:.2f}s, back after "
                      + ", ".join(f"{k} {v:.2f}s" for k, v in back.items()), file=sys.stderr, flush=True)  # fmt: skip
        finally:
            stop.set()
            for c in callers.values():
                c.client.close()
            group.stop()

    summary = {}
    for name in arms:
        backs = [r[name] for r in rows]
        summary[name] = {
            "mean_s": round(statistics.mean(backs), 3),
            "median_s": round(statistics.median(backs), 3),
            "worst_s": round(max(backs), 3),
        }
    ratio = summary["diloco"]["mean_s"] / max(1e-9, summary["grpc-defaults"]["mean_s"])
    print(f"\n{len(rows)} restarts, down {statistics.mean(r['down_s'] for r in rows):.2f}s on average")
    print(f"{'arm':<15}{'mean':>8}{'median':>8}{'worst':>8}   (seconds from listening to the first answer)")
    for name, s in summary.items():
        print(f"{name:<15}{s['mean_s']:>8.2f}{s['median_s']:>8.2f}{s['worst_s']:>8.2f}")
    print(f"diloco / grpc-defaults, mean: {ratio:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "restarts": rows,
                                    "summary": summary, "ratio_mean": round(ratio, 3)}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
