"""The run's shared token, rotated during a run: every process that took it from a --token-file
reads the file again when it changes (diloco.security.watched).

    a client (any role)    sends the file's token from its next call on
    the coordinator        takes the new token at once, and the one before it for ROTATION_GRACE_S
                           more: the hosts' files are not all replaced in the same second

A token given as DILOCO_TOKEN, or in code, stays what it was: only a file can be rotated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from diloco.security.watched import WatchedFile

log = logging.getLogger("diloco.security")

# After a rotation, how long the coordinator still takes the token before it: long enough to
# replace every host's file, short enough that a leaked token is shut out soon.
ROTATION_GRACE_S = 300.0


class TokenSource:
    """The token to send (`current`) and the tokens a server takes (`accepted`), at `now`
    (time.monotonic()). `check`: a token's rules (transport.check_token), applied to every
    version of the file as to the first."""

    def __init__(
        self,
        token: str,
        path: str = "",
        check: Callable[[str, str], str] = lambda token, source: token.strip(),
        grace_s: float = ROTATION_GRACE_S,
    ):
        self._fixed = token
        self._file: WatchedFile[str] | None = None
        if path:
            self._file = WatchedFile(
                path, lambda raw: check(raw.decode("utf-8", "replace"), path), "--token-file"
            )
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._previous = ""
        self._rotated_at: float | None = None

    def current(self, now: float) -> str:
        if self._file is None:
            return self._fixed
        with self._lock:
            before = self._file.value
            token, changed = self._file.get(now)
            if changed and token != before:
                self._previous, self._rotated_at = before, now
                log.warning(
                    "--token-file %s holds a new token: it is used from now on (a coordinator takes "
                    "the one before it for %.0f s more)", Path(self._file.path), self.grace_s,
                )  # fmt: skip
            return token

    def accepted(self, now: float) -> tuple[str, ...]:
        token = self.current(now)
        with self._lock:
            if self._previous and self._rotated_at is not None and now - self._rotated_at < self.grace_s:
                return token, self._previous
        return (token,)
