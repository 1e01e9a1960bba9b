"""Seed the compose demo's bucket with the embedded default corpus: the stdlib's .py files.

    python seed_corpus.py s3://diloco/corpus

Uploads the files `diloco.corpus.stdlib_files()` picks (the corpus `diloco run` trains on), keyed by
their path under the stdlib, so the coordinator can partition raw data that lives on S3. The bucket
is created when missing; files already there with the same size are left alone, so a second
`docker compose up` uploads nothing. S3 endpoint and keys come from the standard AWS variables,
as for every diloco process. Waits (bounded) for the object store to take writes.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time

from diloco import store
from diloco.corpus import stdlib_files


def wait_for_bucket(fs, bucket: str, timeout_s: float) -> None:
    """Create the bucket (if missing), retrying while the store comes up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            return
        except Exception as e:  # connection refused, 5xx while volumes come up, ...
            if time.monotonic() > deadline:
                raise SystemExit(f"error: cannot create bucket {bucket!r}: {e!r}") from None
            time.sleep(1.0)
            fs.invalidate_cache()


def seed(target: str, timeout_s: float = 120.0) -> int:
    """Upload the stdlib corpus under `target` (an s3:// URI); return how many files were uploaded."""
    if not target.startswith("s3://"):
        raise SystemExit(f"error: the target must be an s3:// URI, not {target!r}")
    fs, prefix = store.filesystem(target)
    prefix = prefix.rstrip("/")
    wait_for_bucket(fs, prefix.split("/", 1)[0], timeout_s)
    root = sysconfig.get_paths()["stdlib"]
    have = {
        path: info.get("size")
        for path, info in (fs.find(prefix, detail=True) if fs.exists(prefix) else {}).items()
    }
    files = stdlib_files()
    local, remote = [], []
    for path in files:
        key = f"{prefix}/{os.path.relpath(path, root)}"
        if have.get(key) != os.path.getsize(path):
            local.append(path)
            remote.append(key)
    if local:
        fs.put(local, remote)
    print(f"seeded {target}: {len(local)} of {len(files)} files uploaded (the rest were there)", flush=True)
    return len(local)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Upload the stdlib corpus to s3://BUCKET/PREFIX.")
    parser.add_argument("target", help="s3://BUCKET/PREFIX")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the store")
    args = parser.parse_args()
    seed(args.target, args.timeout)
