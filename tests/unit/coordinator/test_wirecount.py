"""The coordinator's byte counts against what a TCP proxy really carried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import wire_check


@pytest.mark.timeout(120)
def test_counted_wire_bytes_match_the_tcp_stream(tmp_path: Path):
    out = tmp_path / "wire.json"
    wire_check.main(["--pushes", "5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["proxy_bytes"] > 100_000
    # Frames, prefixes and headers are counted; only HTTP/2 control frames (settings, pings,
    # window updates) are not, and they are a sliver.
    assert 0.98 <= result["counted_over_proxy"] <= 1.02, result
