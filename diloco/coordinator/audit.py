"""Prove the ledger's promises from its own records: run after any run, crash or chaos.

Checks, each a list of violations (empty: the promise holds):
- every done chunk has exactly one shard, and its file is on the store (no chunk lost);
- no shard row is inside two merged pushes (no token counted twice);
- the merged-token counter equals the tokens of the merged spans, and a consumed shard's rows
  are all inside merged spans (consumed tokens equal merged tokens);
- no lease is held by a worker that has left or been declared lost (no lease outlives its holder);
- every fragment's recorded version has its checkpoint file.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco import store
from diloco.coordinator import checkpoint, leases
from diloco.coordinator.ledger import ledger_path


@dataclass
class AuditReport:
    violations: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "violations": self.violations, **self.facts}


def audit(workdir: str | Path, check_files: bool = True) -> AuditReport:
    path = ledger_path(workdir)
    if not path.exists():
        return AuditReport([f"no ledger at {path}"])
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return _audit(db, Path(workdir), check_files)
    finally:
        db.close()


def _audit(db: sqlite3.Connection, workdir: Path, check_files: bool) -> AuditReport:
    report = AuditReport()
    bad = report.violations

    chunks = db.execute(
        "SELECT c.id, c.state, COUNT(s.id) AS shards FROM chunks c LEFT JOIN shards s ON s.chunk_id = c.id GROUP BY c.id"
    ).fetchall()
    for c in chunks:
        if c["state"] == "done" and c["shards"] != 1:
            bad.append(f"chunk {c['id']} is done with {c['shards']} shards")
        if c["state"] != "done" and c["shards"] > 1:
            bad.append(f"chunk {c['id']} ({c['state']}) has {c['shards']} shards")
    states: dict[str, int] = {}
    for c in chunks:
        states[c["state"]] = states.get(c["state"], 0) + 1
    report.facts["chunks"] = states

    shards = {r["id"]: r for r in db.execute("SELECT * FROM shards")}
    if check_files:
        missing = [sid for sid, s in shards.items() if s["state"] != "corrupt" and not store.exists(s["uri"])]
        bad.extend(f"shard {sid} file is missing: {shards[sid]['uri']}" for sid in missing)

    merged: dict[int, list[leases.Range]] = {}
    for r in db.execute(
        "SELECT s.shard_id, s.row_start, s.row_end FROM spans s JOIN pushes p ON p.push_id = s.push_id WHERE p.state = 'merged'"
    ):
        merged.setdefault(r[0], []).append((r[1], r[2]))
    span_tokens = 0
    for sid, ranges in merged.items():
        if leases.overlaps(ranges):
            bad.append(f"shard {sid}: a row is inside two merged pushes (counted twice)")
        shard = shards.get(sid)
        if shard is None:
            bad.append(f"merged rows of unknown shard {sid}")
            continue
        span_tokens += sum(b - a for a, b in ranges) * (shard["tokens"] // max(1, shard["rows"]))
    for sid, shard in shards.items():
        if (
            shard["state"] == "consumed"
            and shard["rows"]
            and leases.covered_rows(merged.get(sid, [])) < shard["rows"]
        ):
            bad.append(f"shard {sid} is consumed but not all its rows were merged")
    counters = {r[0]: r[1] for r in db.execute("SELECT name, value FROM counters")}
    counted = int(counters.get("tokens_merged", 0))
    if counted != span_tokens:
        bad.append(f"merged-token counter {counted} differs from the merged spans' {span_tokens} tokens")
    report.facts["tokens_merged"] = span_tokens

    gone = {r[0] for r in db.execute("SELECT id FROM workers WHERE state != 'active'")}
    for table in ("chunks", "shards"):
        for r in db.execute(f"SELECT id, holder FROM {table} WHERE state = 'leased'"):
            if r["holder"] in gone:
                bad.append(f"{table[:-1]} {r['id']} is leased by {r['holder']}, who is gone")

    meta = {r[0]: r[1] for r in db.execute("SELECT key, value FROM meta")}
    config = json.loads(meta.get("config", "{}"))
    root = (config.get("data") or {}).get("store") or str(workdir.resolve())
    versions = {int(k.split(".")[1]): int(v) for k, v in meta.items() if k.startswith("fragment_version.")}
    if check_files:
        for p, v in sorted(versions.items()):
            if not store.exists(checkpoint.fragment_uri(store.join(root, "checkpoints"), p, v)):
                bad.append(f"fragment {p} is at version {v} but its checkpoint file is missing")
    report.facts["fragment_versions"] = [versions[p] for p in sorted(versions)]
    report.facts["rounds"] = db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
    report.facts["quarantined"] = [
        {"chunk": r[0], "error": r[1]}
        for r in db.execute("SELECT id, error FROM chunks WHERE state = 'quarantined'")
    ]
    return report
