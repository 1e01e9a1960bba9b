"""`diloco status --watch`: a refresh loop that waits out a coordinator that does not answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc


def unreachable_line(since: float, now: float, cause: str) -> str:
    """What a watch shows while the coordinator does not answer: since when (wall clock), for how
    long, and gRPC's last word on it ("Connection refused")."""
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    return f"coordinator unreachable since {clock} ({max(0.0, now - since):.0f} s): {cause}"


def watch_status(
    fetch: Callable[[], dict[str, Any]],
    show: Callable[[dict[str, Any] | None, str | None], None],
    every_s: float,
    *,
    now: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    refreshes: int | None = None,
) -> None:
    """`diloco status --watch`: fetch() every `every_s` and show(detail, None); a coordinator that
    does not answer (restarting, a network cut: the retryable codes workers wait out too) is
    waited for, shown as show(None, unreachable_line(...)) counted from its first failed refresh,
    until it answers again. Any other refusal (a wrong identity) ends the watch: it would not
    change by waiting. Runs until Ctrl-C, or `refreshes` shows (tests)."""
    from diloco.client import RETRYABLE
    from diloco.security.transport import connect_cause

    down_since: float | None = None
    shown = 0
    while refreshes is None or shown < refreshes:
        if shown:
            sleep(every_s)
        try:
            detail = fetch()
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE:
                raise
            at = now()
            down_since = at if down_since is None else down_since
            show(None, unreachable_line(down_since, at, connect_cause(e.details() or "") or e.code().name))
        else:
            down_since = None
            show(detail, None)
        shown += 1
