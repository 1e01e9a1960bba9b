"""The pushes a learner made after its last saved state: what lets a state older than a push resume.

A state (local_state) holds the steps it was copied at as unpushed. Once a push leaves after the
copy, resuming that state as it is would push those steps a second time, so a copy used to
follow every push, whatever the cost budget allowed; for a large model, whose copies the budget
spaces out (state_cadence), most kills then found a state older than the last push and resumed
nothing. Each push the budget keeps a copy from following is written here instead (its header and
what it carries: one fragment's delta, a fraction of a copy), by the writer thread, one file per
push, numbered by the learner's push count.

At a resume, the pushes after the state are replayed on it (`replay`): each carries its rows as it
did in the dead life, becomes the push in flight of its fragment (sent again with its own push_id,
for the ledger to answer, as any push in flight at a kill), and its fragment starts over from the
run's current version of it (the dead life's steps on it went with the push). Every other fragment
goes on from the state. A missing or torn entry means no resume: the marker (pushed_count) says how
many pushes left, and each needs its entry.
"""

from __future__ import annotations

import base64
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.compute.local_state import LocalState
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.local_state")


@dataclass(frozen=True)
class JournaledPush:
    count: int  # the learner's push count with this push (StateWriter.push_count)
    header: pb.TensorHeader
    tensors: dict[str, torch.Tensor]


def entry_path(state: Path, count: int) -> Path:
    return state.with_name(f"{state.stem}.push-{count:08d}")


def entries(state: Path) -> list[tuple[int, Path]]:
    """The journal's files beside `state`, by push count."""
    found = []
    for path in state.parent.glob(f"{state.stem}.push-*"):
        suffix = path.name.rsplit("-", 1)[1]
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def write(state: Path, push: JournaledPush) -> None:
    """Atomically (a temporary file, then a rename). No fsync: the entry must outlive the process,
    as the marker does; a machine that loses its page cache loses the marker too, and an entry
    missing for a push noted means no resume, never a wrong one."""
    path = entry_path(state, push.count)
    tmp = path.with_name(path.name + ".tmp")
    header = base64.b64encode(push.header.SerializeToString()).decode()
    save_file({k: v.contiguous() for k, v in push.tensors.items()}, str(tmp), metadata={"header": header})
    os.replace(tmp, path)


def drop(state: Path, upto: int | None = None) -> None:
    """Remove the entries a saved state holds already (push count <= upto; None: all, with any
    temporary file a kill left half written)."""
    if upto is None:
        for path in state.parent.glob(f"{state.stem}.push-*"):
            path.unlink(missing_ok=True)
        return
    for count, path in entries(state):
        if count <= upto:
            path.unlink(missing_ok=True)


def after(state: Path, count: int) -> list[JournaledPush]:
    """The entries after push `count`, in order, up to the first missing or unreadable one."""
    out: list[JournaledPush] = []
    for n, path in entries(state):
        if n <= count:
            continue
        if n != count + len(out) + 1:
            break
        try:
            with safe_open(str(path), framework="pt") as f:
                header = pb.TensorHeader()
                header.ParseFromString(base64.b64decode(f.metadata()["header"]))
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
        except Exception as e:  # a torn entry ends the journal there
            log.warning("push journal entry %s unreadable (%s)", path, e)
            break
        out.append(JournaledPush(n, header, tensors))
    return out


def replay(state: LocalState, pushes: list[JournaledPush], *, keeps_overlap: bool) -> set[int]:
    """Bring `state` past the pushes the dead life made after it; returns the fragments pushed,
    which start over from the run's current version (the caller pulls them).

    keeps_overlap: an apply keeps the steps since its push (sync.keep_overlap with τ > 0 and no
    mixing); else it overwrites its fragment, and the rows waiting on it stop waiting
    (RowBook.overwritten), as they did in the dead life before it pushed the fragment again."""
    pushed: set[int] = set()
    for push in pushes:
        p = push.header.fragment
        f = state.fragments[p]
        if f.in_flight and not keeps_overlap:  # its merge was applied before this push left
            state.rows.overwritten(p)
        # At time 0 of the resuming life's inner steps, as rows loaded from disk are: the dead
        # life's time (state.busy_s) was its own, reported as kept in its heartbeats; carried here
        # at that time, it counted again as the new life's kept work (goodput over 100% of it).
        state.rows.carry(p, len(state.fragments), 0.0)
        f.in_flight = True
        f.push = (push.header, push.tensors)
        state.pushes[p] = f.push
        state.push_count = push.count
        pushed.add(p)
    return pushed
