"""The global model's held-out loss after every merge of a finished `diloco run`, and against a twin
run at matched merged tokens: which merge made the model worse, and how far apart two runs are
over their last part rather than at their last merge alone.

    python benchmarks/merge_evals.py RUN_DIR [--twin FAULT_FREE_DIR] [--from-share 0.5]

The run must keep every checkpoint (`--set coordinator.keep_versions=0`); `chaos.py --history`
does that for both runs of each pair. The global model is a staircase in merged tokens: it only
changes at a merge, and a merge of the fragment that carries most of the loss can move it by as
much as 2% at once. Two runs' last merges land at different points of that staircase, so their
final losses differ by where their last merges fell as well as by what the runs learned;
`--twin` compares the two staircases at every matched token count from `--from-share` of the run
to its end (mean, worst and best gap) next to the gap at the end.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sqlite3
from pathlib import Path
from typing import Any, NamedTuple

import torch

from diloco import store
from diloco.coordinator import merging
from diloco.coordinator.checkpoint import load_fragment, load_model_params
from diloco.coordinator.workdir import store_root
from diloco.data.shard import concat_columns, read_shard
from diloco.evaluate import evaluate
from diloco.export import global_model
from diloco.local.evaluation import EVAL_MAX_BATCHES
from diloco.results import held_out_split

_FILE = re.compile(r"fragment-(\d+)-v(\d+)\.safetensors$")


class MergeStep(NamedTuple):
    """One merge of a kept run, ready to be taken again: the fragment before it, the outer
    gradient it applied (scaled as the run scaled it), its hyper-parameters, and how far taking
    it again from the stored v − 1 lands from the stored v (0 up to float error: the same rule)."""

    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    grad: dict[str, torch.Tensor]
    lr: float
    mu: float
    nesterov: bool
    work: float
    error: float

    def take(
        self, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], scale: float = 1.0
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The outer step of this merge, its gradient times `scale`, from (params, momentum)."""
        grad = {n: g * scale for n, g in self.grad.items()}
        return merging.outer_step(params, momentum, grad, self.lr, self.mu, self.nesterov, fraction=self.work)


class RunModel:
    """A finished run's model, its checkpoints and its held-out split: the loss of any
    combination of fragment versions (`loss_of`)."""

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.cfg, self.model, self.final = global_model(self.workdir)
        self.root = store.join(store_root(self.cfg, str(self.workdir)), "checkpoints")
        shards = [read_shard(s["uri"], s["checksum"]) for s in held_out_split(self.workdir)[0]]
        self.columns = concat_columns(shards)

    def kept(self) -> set[tuple[int, int]]:
        """(fragment, version) of every checkpoint file on the store."""
        files = store.list_files(store.join(self.root, "fragment-*"))
        return {(int(m[1]), int(m[2])) for f in files if (m := _FILE.search(f))}

    def loss_of(self, versions: list[int], replace: dict[str, torch.Tensor] | None = None) -> float:
        """The held-out loss at these versions, with `replace`'s tensors in place of theirs."""
        params = {**load_model_params(self.root, versions), **(replace or {})}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        return evaluate(self.model, self.columns, self.cfg.train.batch_size, "cpu", EVAL_MAX_BATCHES).loss

    def merge_step(self, fragment: int, version: int, pushes: int, steps: int, coverage: float) -> MergeStep:
        """The merge that made `version` of `fragment` (its round's pushes, steps and coverage as
        `rounds` gives them): its outer gradient comes back exactly from the two checkpoints around
        it, m_v = g + μ^f · m_{v−1}. Needs versions v − 1 and v kept."""
        cfg = self.cfg
        before, m_before = load_fragment(self.root, fragment, version - 1)
        after, m_after = load_fragment(self.root, fragment, version)
        live = round(pushes / coverage) if coverage > 0 else pushes
        work = merging.work_fraction(steps, live, cfg.train.inner_steps)
        lr, mu = merging.outer_hyper(
            cfg.sync.outer_lr, cfg.sync.outer_momentum, cfg.sync.outer_warmup_rounds, version - 1
        )
        grad = {n: m_after[n] - mu**work * m_before[n] for n in m_before}
        step = MergeStep(before, m_before, grad, lr, mu, cfg.sync.nesterov, work, 0.0)
        check, _ = step.take(before, m_before)
        return step._replace(error=max(float((check[n] - after[n]).abs().max()) for n in after))

    def rounds(self) -> list[tuple[Any, ...]]:
        """(fragment, version, closed, pushes, tokens, steps, reason, scale) of every merge, in order."""
        with sqlite3.connect(self.workdir / "state" / "ledger.sqlite") as db:
            return db.execute(
                "SELECT fragment, version, closed, pushes, tokens, steps, reason, scale FROM rounds ORDER BY closed"
            ).fetchall()


def merge_history(workdir: str | Path) -> list[dict[str, Any]]:
    """Every merge in the order it closed, with the held-out loss of the global model it made
    (None where a version's file is gone: merges published together share the last one's file).
    `tokens`: merged tokens so far, the mean over fragments (every token is merged once into each)."""
    run = RunModel(workdir)
    kept, rounds = run.kept(), run.rounds()
    versions, merged, history = [0] * len(run.final), 0, []
    for fragment, version, closed, pushes, tokens, steps, reason, scale in rounds:
        versions[fragment] = version
        merged += tokens
        loss = run.loss_of(versions) if all((p, v) in kept for p, v in enumerate(versions)) else None
        history.append({
            "at_s": closed - rounds[0][2], "fragment": fragment, "version": version, "pushes": pushes,
            "steps": steps, "scale": scale, "reason": reason, "tokens": merged / len(run.final), "loss": loss,
        })  # fmt: skip
    return history


def _loss_at(steps: list[tuple[float, float]], tokens: float) -> float:
    """The staircase's value at `tokens`: the loss after the last merge at or before it."""
    i = bisect.bisect_right([t for t, _ in steps], tokens) - 1
    return steps[max(i, 0)][1]


def matched_gap(
    twin: list[dict[str, Any]], run: list[dict[str, Any]], from_share: float = 0.5
) -> dict[str, float]:
    """`run` over `twin`, loss ratio − 1 at 200 matched token counts from `from_share` of the
    shorter run to its end: their mean, worst and best, and the ratio of the final losses."""
    a = [(h["tokens"], h["loss"]) for h in twin if h["loss"] is not None]
    b = [(h["tokens"], h["loss"]) for h in run if h["loss"] is not None]
    if not (a and b):
        raise ValueError("a run without evaluated merges: was it run with coordinator.keep_versions=0?")
    end = min(a[-1][0], b[-1][0])
    points = [end * (from_share + (1 - from_share) * k / 200) for k in range(201)]
    gaps = [_loss_at(b, t) / _loss_at(a, t) - 1 for t in points]
    return {
        "from_share": from_share,
        "mean": sum(gaps) / len(gaps),
        "worst": max(gaps),
        "best": min(gaps),
        "final": b[-1][1] / a[-1][1] - 1,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--twin", type=Path, default=None, help="a run to compare with at matched merged tokens")
    p.add_argument("--from-share", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    history = merge_history(args.run)
    previous = None
    print(
        f"{'at s':>6} {'frag':>4} {'ver':>4} {'pushes':>6} {'steps':>5} {'scale':>5} {'tokens':>9} {'loss':>7} {'change':>8}"
    )
    for h in history:
        loss = "" if h["loss"] is None else f"{h['loss']:.4f}"
        change = "" if h["loss"] is None or previous is None else f"{h['loss'] - previous:+.4f}"
        print(f"{h['at_s']:6.1f} {h['fragment']:>4} {h['version']:>4} {h['pushes']:>6} {h['steps']:>5} "
              f"{h['scale']:5.2f} {h['tokens']:9.0f} {loss:>7} {change:>8}  {h['reason']}")  # fmt: skip
        previous = h["loss"] if h["loss"] is not None else previous
    payload: dict[str, Any] = {"run": str(args.run), "history": history}
    if args.twin is not None:
        gap = matched_gap(merge_history(args.twin), history, args.from_share)
        payload["gap"] = gap
        print(f"against {args.twin.name} from {gap['from_share']:.0%} of the run: mean {gap['mean']:+.2%}, "
              f"worst {gap['worst']:+.2%}, best {gap['best']:+.2%}; final {gap['final']:+.2%}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
