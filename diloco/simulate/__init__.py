"""A discrete-event simulator of goodput at scale: DP, elastic DP, synchronous and Decoupled DiLoCo.

The Decoupled DiLoCo paper (arXiv 2604.21428) answers "what does it buy at a million chips?"
with a simulation; this package is that simulation, fed with what this project measures
(`diloco simulate --calibrate RUN_DIR`) and stated assumptions for the rest.

    config.py      the inputs (keyword-only dataclasses, one docstring per field, sources cited)
    costs.py       bytes on the wire, sync times, a slow slice's toll
    rules.py       what a failure does in each mode: pure functions returning a decision and a reason
    failures.py    every failure of a run, drawn up front from one seeded generator
    books.py       the books (where the chip-time went) and a run's context, shared by the modes
    engine.py      the simpy clock, simulate(cfg, mode) -> Result
    dp.py, sync_diloco.py, decoupled.py   one process per mode
    calibrate.py   a real run's costs, and the configs that replay it or scale it up
    sweep.py       goodput over chip counts (the paper's figure), and one input moved at a time
    report.py      tables, the assumptions beside them, the PNG

simpy and matplotlib are optional (`pip install 'diloco[simulate]'`) and imported when used.
"""

from __future__ import annotations

from diloco.simulate.config import (
    FailureConfig,
    LinkConfig,
    OuterConfig,
    RecoveryConfig,
    SimConfig,
    StragglerConfig,
)
from diloco.simulate.engine import MODES, Result, simulate

__all__ = [
    "MODES",
    "FailureConfig",
    "LinkConfig",
    "OuterConfig",
    "RecoveryConfig",
    "Result",
    "SimConfig",
    "StragglerConfig",
    "simulate",
]
