"""Structured logs: one line per event, `time level component message key=value ...`."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys


def setup_logging(role: str, level: str | None = None) -> None:
    level = level or os.environ.get("DILOCO_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # A crash below Python (a segfault in gRPC or torch, an abort) would otherwise end the role
    # with nothing in its log: this writes every thread's Python stack there first.
    faulthandler.enable(file=sys.stderr, all_threads=True)
