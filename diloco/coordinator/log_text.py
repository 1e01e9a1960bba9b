"""Caller text made fit for one log line.

Whatever a caller sends that the coordinator logs (a shard's or a chunk's error, a leave reason)
goes through `loggable`: cut to a few hundred bytes, and every character that is not printable
(newlines, carriage returns, terminal escapes, Unicode line separators and direction overrides)
written as its escape. Logged raw, one learner's error of "bad\\nFAKE LOG LINE: ..." forged
three lines of the coordinator's log, and a 3 MB one made a 3 MB line (red-team report, 9).
"""

from __future__ import annotations

from diloco.coordinator.limits import cut_text

# What one logged field of a caller's text may take: a line, never a page.
MAX_LOGGED_BYTES = 300


def loggable(text: str, limit: int = MAX_LOGGED_BYTES) -> str:
    """`text` cut to `limit` bytes (limits.cut_text), its unprintable characters escaped: one line."""
    cut = cut_text(text, limit)
    if cut.isprintable():
        return cut
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
