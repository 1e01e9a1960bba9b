"""The compose demo's secrets, made at its first start and never kept in the repo.

    python make_secrets.py DIR

writes into DIR (the `secrets` volume), each only if it is not there yet, so a restart keeps them:

- `token`: the run's shared token (DILOCO_TOKEN_FILE) that every diloco call carries;
- `s3.json`: SeaweedFS's identities file (its -s3.config) with one random access key;
- `aws-credentials`: the same key for the S3 clients (AWS_SHARED_CREDENTIALS_FILE), in the
  shared-credentials format botocore and s3fs read.

The key pair is made once for both files: a half-made pair (one file lost) is made again whole.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path


def _write(path: Path, text: str, mode: int) -> None:
    """Write a new file with `mode` from the start (not chmod after: no moment it is readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_secrets(out: Path) -> list[str]:
    """Make what is missing in `out`; returns the names of the files made."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    token = out / "token"
    if not token.exists():
        _write(token, secrets.token_urlsafe(32), 0o600)
        made.append(token.name)
    identities, credentials = out / "s3.json", out / "aws-credentials"
    if not (identities.exists() and credentials.exists()):
        key, secret = "diloco-" + secrets.token_hex(8), secrets.token_urlsafe(30)
        identity = {
            "name": "diloco",
            "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],  # Admin: the seed makes the bucket
        }
        # Readable by the object store's own user, which need not be ours; the volume is mounted
        # into this demo's containers only.
        _write(identities, json.dumps({"identities": [identity]}, indent=2) + "\n", 0o644)
        _write(
            credentials,
            f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n",
            0o600,
        )
        made += [identities.name, credentials.name]
    return made


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_secrets.py DIR", file=sys.stderr)
        return 2
    made = make_secrets(Path(argv[0]))
    print(f"made: {', '.join(made)}" if made else "every secret was there already: kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
