"""Many runs: goodput over chip counts for each mode (the paper's figure), and what one input moves.

Series keys are what `diloco simulate --json` prints: `dp`, `elastic-dp`, `decoupled-m<M>` per
M, and, when asked for, `sync-diloco-m<M>`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from diloco.simulate.config import SimConfig
from diloco.simulate.engine import Result, simulate
from diloco.simulate.sync_diloco import check_rounds


def series(
    base: SimConfig, *, chips: list[int], learners: list[int], sync_diloco: bool = False
) -> dict[str, dict[int, Result]]:
    """{series key: {chips: Result}}: DP and elastic DP once, the DiLoCo modes once per M.

    Every config is checked before the first run: a bad pair (quorum over one M, learners over
    one chip count) is refused at once, not after the runs before it.
    """
    for n in chips:
        for m in learners:
            cfg = base.with_(chips=n, chips_per_learner=None, learners=m)
            cfg.check()
            if sync_diloco:
                check_rounds(cfg)
    out: dict[str, dict[int, Result]] = {"dp": {}, "elastic-dp": {}}
    for m in learners:
        out[f"decoupled-m{m}"] = {}
        if sync_diloco:
            out[f"sync-diloco-m{m}"] = {}
    for n in chips:
        # DP ignores M; one of the sweep's own (all checked above) keeps its check from tripping
        # on base's M (e.g. more learners than a small chip count).
        cfg = base.with_(chips=n, chips_per_learner=None, learners=min(learners))
        out["dp"][n] = simulate(cfg, "dp")
        out["elastic-dp"][n] = simulate(cfg, "elastic-dp")
        for m in learners:
            out[f"decoupled-m{m}"][n] = simulate(cfg.with_(learners=m), "decoupled")
            if sync_diloco:
                out[f"sync-diloco-m{m}"][n] = simulate(cfg.with_(learners=m), "sync-diloco")
    return out


def goodput_json(results: dict[str, dict[int, Result]]) -> dict[str, dict[str, float]]:
    """The script interface: {series: {"<chips>": goodput}}."""
    return {key: {str(n): round(r.goodput, 4) for n, r in row.items()} for key, row in results.items()}


@dataclass(frozen=True)
class Variant:
    """One input changed from the base, and what it does to the DiLoCo modes."""

    name: str
    decoupled: Result
    sync_diloco: Result


def variants(base: SimConfig) -> list[tuple[str, SimConfig]]:
    """The inputs the README's sensitivity table moves, one at a time."""
    m = base.m
    out: list[tuple[str, SimConfig]] = [("base", base)]
    for k in sorted({max(1, m // 2), m} - {base.outer.quorum}):
        out.append((f"quorum K = {k}", replace(base, outer=replace(base.outer, quorum=k))))
    for h in (100, 500):
        if h != base.outer.inner_steps:
            out.append((f"H = {h}", replace(base, outer=replace(base.outer, inner_steps=h))))
    for codec in ("fp32", "bf16", "int8", "int4"):
        if codec != base.link.codec:
            link = replace(base.link, codec=codec, bits_per_param=None)
            out.append((f"codec {codec}", replace(base, link=link)))
    slow = replace(base.link, bandwidth_gbps=base.link.bandwidth_gbps / 10)
    out.append((f"link {slow.bandwidth_gbps:g} Gbit/s", replace(base, link=slow)))
    out.append(
        ("state lost with the learner", replace(base, recovery=replace(base.recovery, state_survives=False)))
    )
    out.append(
        ("restart 600 s (no hot spare)", replace(base, recovery=replace(base.recovery, restart_s=600.0)))
    )
    return out


def sensitivity(base: SimConfig) -> list[Variant]:
    """Decoupled and synchronous DiLoCo under each variant of the base job."""
    check_rounds(base)  # every variant runs synchronous DiLoCo (the H variants only lengthen rounds)
    return [
        Variant(name, simulate(cfg, "decoupled"), simulate(cfg, "sync-diloco"))
        for name, cfg in variants(base)
    ]
