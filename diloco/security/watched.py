"""A file a long-running process reads again when it changes: a coordinator's --tls-crl, a role's
--token-file. Its modification time is looked at most once a second (every call the guard checks
would otherwise stat it); what a new version holds is the caller's to parse, and a version that
does not parse leaves the last good one in force."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from diloco.errors import DilocoError

log = logging.getLogger("diloco.security")

# How often the file's modification time is looked at: a change takes effect within this.
RECHECK_S = 1.0
T = TypeVar("T")


def reload_due(now: float, checked_at: float | None, every_s: float = RECHECK_S) -> bool:
    """Whether to look at the file again: at most once every `every_s`."""
    return checked_at is None or now - checked_at >= every_s


class WatchedFile(Generic[T]):
    """`parse(bytes)` of the file at `path`, read at start (a DilocoError naming `flag` when it
    cannot be) and again when it changes. A version that cannot be read or parsed (a half-copied
    file) keeps the last value, said once in the log per version, not every second."""

    def __init__(self, path: str | Path, parse: Callable[[bytes], T], flag: str):
        self.path, self.parse, self.flag = Path(path), parse, flag
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        try:
            self._mtime: int | None = self.path.stat().st_mtime_ns
            self.value = parse(self.path.read_bytes())
        except OSError as e:
            raise DilocoError(f"{flag} {self.path}: {e.strerror}") from e
        except DilocoError as e:
            raise DilocoError(f"{flag} {self.path} {e}") from e
        self._failed: tuple[int | None, str] = (None, "")  # the version that failed, and why

    def get(self, now: float) -> tuple[T, bool]:
        """The value, and whether it changed at this call."""
        with self._lock:
            changed = False
            if reload_due(now, self._checked_at):
                self._checked_at = now
                changed = self._reload()
            return self.value, changed

    def _reload(self) -> bool:
        mtime: int | None = None
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime in (self._mtime, self._failed[0]):
                return False
            value = self.parse(self.path.read_bytes())
        except (OSError, DilocoError) as e:
            failed = (mtime, str(e))
            if failed != self._failed:
                log.error(
                    "%s %s could not be read again (%s): the last one stays in force", self.flag, self.path, e
                )
            self._failed = failed
            return False
        self.value, self._mtime, self._failed = value, mtime, (None, "")
        return True
