"""A learner's state on its own disk, so that a killed learner goes on where it died.

Without it a kill loses every inner step since the learner's last complete set of fragment
pushes (their rows go back to the pool), and the restart pulls every fragment in full. With it,
every `train.local_state_every_s` (within the cost budget of state_cadence) the training thread
copies what it holds (parameters, inner optimizer, each fragment's base and counters, the push in
flight, error-feedback residuals, the rows no merge has counted yet) and a writer thread
(state_writer) saves it as one safetensors file (atomically: a temporary file, fsync, then a
rename; nothing is pickled). A restarted learner with the same id
resumes from it when `resume_decision` says its bases are still ones the syncer accepts pushes
on, and then needs no pull at all.

Exactly-once still holds: the restored rows ride on the learner's next pushes, and the ledger cuts
out any row someone else has meanwhile pushed (Ledger.record_push). A push in flight at the kill
is sent again with its own push_id, so the ledger answers for it instead of merging it twice.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.compute.held import HeldFragment
from diloco.compute.rows import AwaitingCover, RowBook, Unpushed
from diloco.coordinator.syncer import staleness_refusal
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.local_state")

FORMAT = "diloco-learner-state-v1"


@dataclass
class LocalState:
    """Everything a learner needs to go on from where it was (see the module docstring)."""

    run_id: str
    worker_id: str
    inner_steps: int
    busy_s: float  # this life's time in inner steps when the copy was taken
    first_loss: float
    schedule_shift: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch.optim state_dict
    fragments: list[HeldFragment]
    pushes: dict[int, tuple[pb.TensorHeader, dict[str, torch.Tensor]]]  # fragment -> push in flight
    residual: dict[str, torch.Tensor]
    rows: RowBook
    held_shards: list[int]
    # The pushes of work this learner had made when the copy was taken (StateWriter.push_count):
    # one noted after it means the copy still holds that push's steps as unpushed.
    push_count: int = 0
    written_at: float = field(default_factory=time.time)
    # What a row of each shard the state names counts for (tokens). Without it a resumed learner
    # claimed 0 tokens for its last life's unmerged rows until it stepped on a shard of its own,
    # and the budget's allowances overshot (a chaos run merged 1.028 M of a 1.0 M budget).
    row_tokens: dict[int, int] = field(default_factory=dict)
    # The life's time per inner step at the copy: a resumed life measures how far behind the
    # others it is with it, before its own first (slow) steps give one (0: not known).
    step_time_s: float = 0.0

    def row_spans(self) -> list[tuple[int, int, int]]:
        """Every row trained on that no merge has counted: they ride on the resumed learner's pushes."""
        return self.rows.spans()


@dataclass(frozen=True)
class ResumeDecision:
    resume: bool
    reason: str


def resume_decision(
    state: LocalState | None,
    *,
    run_id: str,
    worker_id: str,
    shapes: dict[str, tuple[int, ...]],
    current_versions: list[int],
    max_staleness: int,
    pushes_noted: int | None = None,
    journaled: tuple[int, ...] = (),
) -> ResumeDecision:
    """Whether a restarted learner goes on from its local state, and why (or why not).

    pushes_noted: how many pushes of work the dead life had made (pushed_count). A push after the
    state was copied carried work the state still holds as unpushed: resumed as it is, it would
    be pushed and merged a second time (measured: a chaos run whose rounds were all whole ended
    +5% once a learner killed just after a push re-sent its steps from the older state). Pushes
    are counted, not dated by step: a copy and a push at the same step come in either order (the
    end game hands in after the step's copy), and a step said "the state holds it" when it did not.
    journaled: the fragments of the pushes after the state that the push journal holds, in order
    (push_journal.after): those pushes are replayed on the state, and their fragments start over
    from the run's current version (no staleness to refuse).
    """
    if state is None:
        return ResumeDecision(False, "no local state")
    if pushes_noted is not None and pushes_noted > state.push_count + len(journaled):
        return ResumeDecision(
            False,
            f"{pushes_noted - state.push_count} push(es) came after the state (step {state.inner_steps}), "
            f"{len(journaled)} of them in the push journal: resumed, that work would be merged twice",
        )
    if state.run_id != run_id or state.worker_id != worker_id:
        return ResumeDecision(
            False, f"local state is from another run or worker ({state.run_id}/{state.worker_id})"
        )
    saved = {n: tuple(t.shape) for n, t in state.params.items()}
    if saved != shapes:
        return ResumeDecision(False, "local state holds another model's parameters")
    if len(current_versions) != len(state.fragments):
        return ResumeDecision(
            False, f"local state has {len(state.fragments)} fragment(s), the run {len(current_versions)}"
        )
    for p, (f, now) in enumerate(zip(state.fragments, current_versions, strict=True)):
        if p in journaled:
            continue
        if refusal := staleness_refusal(max_staleness, f.version, now):
            return ResumeDecision(False, f"fragment {p}: {refusal}")
    age = time.time() - state.written_at
    versions = [f.version for f in state.fragments]
    replayed = f", replaying {len(journaled)} push(es) from the journal" if journaled else ""
    return ResumeDecision(
        True,
        f"resuming at step {state.inner_steps} from state {age:.1f}s old (versions {versions}, "
        f"run at {current_versions}){replayed}",
    )


# -- capture and restore (on the training thread) ----------------------------------------------


def copy_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the inner optimizer's state (it changes in place at every step)."""
    sd = optimizer.state_dict()
    state = {
        i: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": plain_groups(sd["param_groups"])}


def plain_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A state_dict's param groups (learning rate, betas, ...) as plain data, apart from the
    optimizer's own (which later steps change)."""
    return json.loads(json.dumps(groups))


# -- the file ----------------------------------------------------------------------------------


def state_path(directory: str | Path, worker_id: str) -> Path:
    return Path(directory) / f"{worker_id}.safetensors"


def pushed_path(state: Path) -> Path:
    """Beside the state: how many pushes of work the learner made, written before each leaves."""
    return state.with_suffix(".pushed")


def pushed_count(state: Path) -> int | None:
    """How many pushes of work the learner had made when it last noted one (note_push), or None."""
    try:
        return int(json.loads(pushed_path(state).read_text())["pushes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _spans_json(rows: Unpushed) -> list[list[int]]:
    return [list(s) for s in rows.spans]  # released shards are not kept: the old leases are given back


def _spans(raw: list[list[int]]) -> Unpushed:
    rows = Unpushed()
    for sid, a, b in raw:
        rows.spans.append((int(sid), int(a), int(b)))
    return rows


def save(path: Path, state: LocalState) -> None:
    """Write atomically: a reader (the restarted learner) sees the old file or the new, whole."""
    tensors: dict[str, torch.Tensor] = {f"param/{n}": t for n, t in state.params.items()}
    for i, s in state.optimizer["state"].items():
        for k, v in s.items():
            tensors[f"opt/{i}/{k}"] = v
    frags = []
    for p, f in enumerate(state.fragments):
        tensors.update({f"base/{p}/{n}": t for n, t in f.base.items()})
        tensors.update({f"at_push/{p}/{n}": t for n, t in f.at_push.items()})
        frags.append(
            {"version": f.version, "steps": f.steps, "tokens": f.tokens, "loss_sum": f.loss_sum,
             "in_flight": f.in_flight, "apply_at": f.apply_at, "counted_at_push": list(f.counted_at_push)}
        )  # fmt: skip
    pushes = {}
    for p, (header, blobs) in state.pushes.items():
        pushes[str(p)] = base64.b64encode(header.SerializeToString()).decode()
        tensors.update({f"push/{p}/{n}": t for n, t in blobs.items()})
    tensors.update({f"residual/{n}": t for n, t in state.residual.items()})
    meta = {
        "format": FORMAT,
        "run_id": state.run_id,
        "worker_id": state.worker_id,
        "inner_steps": state.inner_steps,
        "busy_s": state.busy_s,
        "first_loss": state.first_loss,
        "schedule_shift": state.schedule_shift,
        "optimizer_groups": state.optimizer["param_groups"],
        "fragments": frags,
        "pushes": pushes,
        "unpushed": _spans_json(state.rows.unpushed),
        "awaiting": [
            {"spans": _spans_json(g.rows), "waiting": sorted(g.waiting)} for g in state.rows.awaiting
        ],
        "resolved": _spans_json(state.rows.resolved),
        "held_shards": state.held_shards,
        "push_count": state.push_count,
        "written_at": state.written_at,
        "row_tokens": {str(sid): n for sid, n in state.row_tokens.items()},
        "step_time_s": state.step_time_s,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"state": json.dumps(meta)})
    # On disk before the rename (a rename can outlive the data it names), and inside the save's
    # time: the copies' budget (state_cadence) then counts the disk's work, not the page cache's.
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, fragment_names: list[list[str]]) -> LocalState | None:
    """The state saved at `path`, or None (none there, or unreadable: a fresh start, with a line why)."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        return _from_file(meta, tensors, fragment_names)
    except Exception as e:  # a torn or foreign file must never stop a learner from starting
        log.warning("local state %s unreadable (%s): starting fresh", path, e)
        return None


def _section(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _from_file(meta: dict[str, Any], tensors: dict[str, torch.Tensor], names: list[list[str]]) -> LocalState:
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in _section(tensors, "opt/").items():
        i, k = key.split("/", 1)
        opt_state.setdefault(int(i), {})[k] = v
    frags = []
    for p, raw in enumerate(meta["fragments"]):
        f = HeldFragment(names[p] if p < len(names) else [])
        f.version, f.steps, f.tokens, f.loss_sum = (
            raw["version"],
            raw["steps"],
            raw["tokens"],
            raw["loss_sum"],
        )
        f.in_flight, f.apply_at = raw["in_flight"], raw["apply_at"]
        f.counted_at_push = tuple(raw["counted_at_push"])  # type: ignore[assignment]
        f.base = _section(tensors, f"base/{p}/")
        f.at_push = _section(tensors, f"at_push/{p}/")
        frags.append(f)
    pushes = {}
    for p, encoded in meta["pushes"].items():
        header = pb.TensorHeader()
        header.ParseFromString(base64.b64decode(encoded))
        pushes[int(p)] = (header, _section(tensors, f"push/{p}/"))
    return LocalState(
        run_id=meta["run_id"],
        worker_id=meta["worker_id"],
        inner_steps=int(meta["inner_steps"]),
        busy_s=float(meta["busy_s"]),
        first_loss=float(meta["first_loss"]),
        schedule_shift=int(meta["schedule_shift"]),
        params=_section(tensors, "param/"),
        optimizer={"state": opt_state, "param_groups": meta["optimizer_groups"]},
        fragments=frags,
        pushes=pushes,
        residual=_section(tensors, "residual/"),
        rows=RowBook(
            _spans(meta["unpushed"]),
            [AwaitingCover(_spans(g["spans"]), set(g["waiting"])) for g in meta["awaiting"]],
            _spans(meta["resolved"]),
        ),
        held_shards=[int(s) for s in meta["held_shards"]],
        push_count=int(meta["push_count"]),
        written_at=float(meta["written_at"]),
        row_tokens={int(sid): int(n) for sid, n in meta.get("row_tokens", {}).items()},
        step_time_s=float(meta.get("step_time_s", 0.0)),
    )
