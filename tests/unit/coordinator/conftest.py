"""The coordinator tests' fixtures: a fake clock, and a ledger on a real SQLite file that runs on it."""

import pytest

from diloco.coordinator.ledger import Ledger
from tests.support import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def ledger(tmp_path, clock):
    led = Ledger(str(tmp_path / "ledger.sqlite"), clock=clock)
    yield led
    led.close()
