"""What every worker role shares: leaving with a reason when it refuses, and its heartbeat thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from diloco.client import CoordinatorClient
from diloco.errors import DilocoError


@contextmanager
def refusing(client: CoordinatorClient, log: logging.Logger) -> Iterator[None]:
    """A DilocoError inside leaves the run with its reason (one line in the log, a Leave the
    coordinator records), then goes on up: the CLI turns it into a clear error and exit code."""
    try:
        yield
    except DilocoError as error:
        log.error("%s", error)
        client.leave(f"refused: {error}")
        client.close()
        raise


def heartbeat_thread(
    beat: Callable[[], None], period_s: float, stop: threading.Event, log: logging.Logger
) -> threading.Thread:
    """A started daemon thread that calls `beat` every period until `stop`; a failed beat is
    logged and survived (the next one may land; leases outlive a few misses)."""

    def forever() -> None:
        while not stop.wait(period_s):
            try:
                beat()
            except Exception as e:
                log.info("heartbeat failed: %s", e)

    thread = threading.Thread(target=forever, name="heartbeat", daemon=True)
    thread.start()
    return thread
