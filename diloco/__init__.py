"""diloco: resilient, low-communication distributed training (Decoupled DiLoCo)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `diloco.connect` (your own training loop) imports torch and gRPC only when asked for: the
    # CLI and the light roles import this package too.
    if name == "connect":
        from diloco.compute.own_loop import connect

        return connect
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
