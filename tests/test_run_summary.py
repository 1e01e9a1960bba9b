"""The numbers `diloco run` reports beside its own: DDP's bytes, the syncer's longest pause."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.coordinator.ledger import Ledger
from diloco.run import ddp_wire_bytes_per_token, longest_merge_gap


def test_ddp_bytes_per_token_is_the_ring_all_reduce() -> None:
    # 4 ranks, 1000 params: each rank sends 2·3/4·4 B per parameter per step = 6000 B; all ranks
    # 24000 B per step, for 4·16·129 tokens.
    assert ddp_wire_bytes_per_token(1000, 4, 16, 128) == pytest.approx(24000 / (4 * 16 * 129))
    assert ddp_wire_bytes_per_token(1000, 1, 16, 128) == 0.0  # one rank all-reduces nothing


def test_longest_merge_gap_reads_the_rounds(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    now = [100.0]
    ledger = Ledger(str(tmp_path / "state" / "ledger.sqlite"), clock=lambda: now[0])
    for t, version in ((100.0, 1), (103.0, 2), (110.5, 3), (111.0, 4)):
        now[0] = t
        ledger.commit_merge(0, version, [], 0, 0, None, "test")
    ledger.close()
    assert longest_merge_gap(tmp_path) == 7.5
