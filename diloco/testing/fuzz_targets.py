"""What a fuzzed call names, picked from the ledger's facts (diloco.testing.fuzz_oracle.Facts):
the rows of a push (ROWS), its tensors (PUSH_KINDS), an init's tensors (INIT_KINDS), the chunk
and file of a completion, the shard of a report. Pure functions of the facts and the draw, so
the state machine (diloco.testing.fuzz) only makes the calls and judges them."""

from __future__ import annotations

import math
import uuid
from typing import Any

import torch

from diloco.testing.fuzz_oracle import Facts, Verdict, norm, push_verdict
from diloco.v1 import coordinator_pb2 as pb

# A push's kind -> what makes it malformed (refused whatever its rows).
MALFORMED = {
    "nan": "a NaN", "inf": "an inf", "huge_values": "values of 1e30", "wrong_shape": "a wrong shape",
    "wrong_name": "a name not the fragment's", "huge_tokens": "2^60 tokens", "unknown_fragment":
    "an unknown fragment", "wrong_codec": "fp32 bytes under int8",
}  # fmt: skip


def joined_or_refused(facts: Facts, worker: str) -> tuple[Verdict, str]:
    """A call as `worker`: either way while it is joined; else it must be refused."""
    return (Verdict.EITHER, "") if facts.live(worker) else (Verdict.REFUSE, "a worker not joined")


def push_spans(facts: Facts, worker: str, rows: str, pick: int, width: int) -> list[tuple[int, int, int]]:
    """Rows for a push to name, chosen among the ledger's shards by `rows` (ROWS)."""
    train = facts.shards("train")

    def choose(xs: list[Any]) -> Any:
        return xs[pick % len(xs)] if xs else None

    mine = [s for s in train if s["state"] == "leased" and s["holder"] == worker]
    if rows == "all_shards":
        return [(s["id"], 0, 1) for s in train]
    if rows in ("own_again", "others_pushed"):
        pushed = facts.q(
            "SELECT s.shard_id, s.row_start, s.row_end FROM spans s JOIN pushes p USING (push_id) "
            "WHERE p.state IN ('pending', 'merged') AND (p.worker_id = ?) = ? ORDER BY p.received DESC LIMIT 8",
            (worker, rows == "own_again"),
        )
        span = choose(pushed)
        return [] if span is None else [(span[0], span[1], span[2])]
    shard = choose(
        {
            "own": mine,
            "others_held": [s for s in train if s["state"] == "leased" and s["holder"] != worker],
            "never_leased": [s for s in train if not facts.ever_leased(s["id"], worker)],
            "heldout": facts.q("SELECT id, rows FROM shards WHERE split != 'train' ORDER BY id"),
            "corrupt": [s for s in train if s["state"] == "corrupt"],
            "outside": mine or train,
        }.get(rows, [])
    )
    if shard is None:
        return []
    if rows == "outside":
        return [(shard["id"], shard["rows"], shard["rows"] + width)]
    start = max((y for _, y, _ in facts.pushed_rows(shard["id"])), default=0) if rows == "own" else 0
    end = min(shard["rows"], start + width)
    return [(shard["id"], start, end)] if start < end else []


def push_tensors(
    kind: str, init: dict[str, torch.Tensor], frag: Any, reach: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the fragment's parameters, the delta a push of `kind` carries). `reach`: how many H steps
    every train row together could credit."""
    names = [x for x in (frag.names if frag is not None else []) if x in init]
    params = {x: frag.params[x] for x in names} if frag is not None else {}
    tensors = {x: torch.randn_like(init[x]) * 1e-3 for x in names}
    if kind in ("far", "inflated_far") and tensors:
        # Above 10x the parameter norm however many steps the rows could credit; "far" a hundred
        # times over, "inflated_far" just over, with a thousand H steps claimed.
        target = 10 * max(norm(params), 1e-2) * reach * (100.0 if kind == "far" else 1.5)
        tensors = {x: t * (target / max(norm(tensors), 1e-30)) for x, t in tensors.items()}
    first = next(iter(tensors), None)
    if kind == "nan" and first:
        tensors[first].view(-1)[0] = math.nan
    elif kind == "inf" and first:
        tensors[first].view(-1)[0] = math.inf
    elif kind == "huge_values":
        tensors = {x: torch.full_like(t, 1e30) for x, t in tensors.items()}
    elif kind == "wrong_shape" and first:
        tensors[first] = torch.zeros(3, 3)
    elif kind == "wrong_name" and first:
        tensors["not.a.parameter"] = tensors.pop(first)
    elif kind == "empty":
        tensors = {}
    return params, tensors


def init_tensors(kind: str, init: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """An init of `kind` (INIT_KINDS): its tensors and the names it marks as running statistics."""
    tensors, averaged = dict(init), frozenset()
    first = next(iter(init))
    if kind == "marked":
        averaged = frozenset(init)
    elif kind == "unsplittable":
        tensors = {"w": torch.zeros(10)}
    elif kind == "other_model":
        tensors[first] = torch.zeros(init[first].shape[0] + 1, *init[first].shape[1:])
    elif kind == "huge":
        tensors = {n: t * 1e30 for n, t in init.items()}
    return tensors, averaged


def completion_target(
    facts: Facts, chunk_leases: dict[tuple[int, str], str], worker: str, aim: str, pick: int
) -> tuple[int, str]:
    """The chunk and file a completion names: the caller's own attempt, another data worker's,
    the next attempt's file of its own chunk, a shard made already, or `aim` itself (a path)."""
    mine = sorted(k for k, w in chunk_leases.items() if w == worker)
    theirs = sorted(k for k, w in chunk_leases.items() if w != worker)
    made = [(int(r[0]), str(r[1])) for r in facts.q("SELECT chunk_id, uri FROM shards ORDER BY id")]
    pool = {"own": mine, "others": theirs, "other_attempt": mine, "made": made}.get(aim)
    if not pool:
        return pick, aim if pool is None else "/etc/passwd"
    chunk, uri = pool[pick % len(pool)]
    if aim == "other_attempt":  # the same chunk's file of the next attempt
        stem, _, tail = uri.rpartition("-a")
        uri = f"{stem}-a{int(tail.split('.')[0]) + 1}.shard" if tail.split(".")[0].isdigit() else uri + "x"
    return chunk, uri


def report_target(facts: Facts, worker: str, aim: str, pick: int) -> int:
    """The shard a report names: one the caller holds or held last, another's, one it never
    leased, a held-out one, or none at all."""
    every = facts.shards()
    pool = {
        "own_held": [s["id"] for s in every if s["state"] == "leased" and s["holder"] == worker],
        "own_last": [s["id"] for s in every if facts.last_holder(s["id"]) == worker],
        "others": [s["id"] for s in every if s["state"] == "leased" and s["holder"] != worker],
        "never": [s["id"] for s in every if not facts.ever_leased(s["id"], worker)],
        "heldout": [s["id"] for s in every if s["split"] != "train"],
    }.get(aim) or [10**6]
    return pool[pick % len(pool)]


def push_request(
    facts: Facts,
    service: Any,
    init: dict[str, torch.Tensor],
    worker: str,
    kind: str,
    rows: str,
    pick: int,
    width: int,
) -> tuple[pb.TensorHeader, dict[str, torch.Tensor], tuple[Verdict, str]]:
    """A push of `kind` by `worker` naming `rows` (push_spans), its tensors, and what the oracle says
    of it: a valid delta of its rows, or one malformed, stale, inflated or far too large."""
    h, batch = service.config.train.inner_steps, service.config.train.batch_size
    frag = service.fragments[0] if service.fragments else None
    version = frag.version if frag is not None else 0
    base = max(0, version - 100) if kind == "stale" else version
    spans = push_spans(facts, worker, rows, pick, width)
    n = sum(b - a for _, a, b in spans)
    inflated = kind.startswith("inflated")
    header = pb.TensorHeader(
        worker_id=worker, fragment=99 if kind == "unknown_fragment" else 0, version=base,
        codec="int8" if kind == "wrong_codec" else "fp32", inner_steps=1000 * h if inflated else max(1, -(-n // batch)),
        tokens=(1 << 60) if kind == "huge_tokens" else (1 << 40) if inflated else 129 * max(1, n),
        push_id=uuid.uuid4().hex, mean_loss=1.0,
    )  # fmt: skip
    for sid, a, b in spans:
        header.spans.add(shard_id=sid, row_start=a, row_end=b)
    reach = max(1.0, math.ceil(sum(s["rows"] for s in facts.shards("train")) / batch) / h)
    params, tensors = push_tensors(kind, init, frag, reach)
    malformed = MALFORMED.get(kind, "")
    # (No tensors and no tokens is a learner's "nothing this round": a message, not a delta.)
    if kind == "empty":
        spans, header.tokens = [], 0
        del header.spans[:]
        if facts.live(worker):
            return header, tensors, (Verdict.EITHER, "nothing this round")
    if kind == "stale" and version - base > service.config.sync.max_staleness:
        malformed = "a base version past max_staleness"
    verdict = push_verdict(facts, worker, header.fragment, spans, malformed and f"a push with {malformed}",
                           norm(tensors), norm(params), math.ceil(reach * h), h)  # fmt: skip
    if verdict[0] is Verdict.HONEST and kind != "valid":  # claims beyond its rows: credited down
        verdict = (Verdict.EITHER, "claims beyond its rows")
    return header, tensors, verdict
