"""The outer loop alone, in one process, on a step clock: which merge rule costs what.

    python benchmarks/outer_sim.py --learners 2 --offsets 0,17 --quorum 1 --overlap 10

M learners train the real model on the real rows (as benchmarks/ddp_baseline.py makes them) and
sync fragments through the syncer's own functions (MergeAccumulator, coverage_scale, outer_step),
but time is a step counter, not a clock: learner m starts `offset[m]` steps late, a round closes
when every learner has pushed or `window` steps after its first push, and a merged fragment is
applied τ steps after its push. Nothing here depends on how busy the machine is, so two arms differ
only by the rule under test, and one run takes a minute instead of a benchmark's quarter hour.
What it is for: separating the effects of partial rounds, staleness, overlap and fragments on the
eval loss at equal tokens (issue: Decoupled vs synchronous DiLoCo).

    python benchmarks/outer_sim.py --learners 3 --quorum 0 --inner-steps 20 --hostile 2

adds a hostile learner (RT2's defect 1: a learner steers within the norm bound) against the
coordinator's outlier rule (`limits.norm_outlier`), or with `--norm-rule clip` against clipping
each push to the bound instead of refusing it. Each learner's pushes are watched as the
coordinator watches them (`coordinator/pusher_watch.py`, its bars `--set sync.suspect_norm_ratio=…`,
`sync.suspect_alignment_gap`): printed per learner, its figures, whether it ends suspect, and after
how many of its pushes it was first found so. With `--set sync.refuse_suspects=true` a learner's
pushes are refused while it is named; a push deviating from the fragment's mean step by more than
sync.center_clip × the others' median is pulled back to it, as the coordinator's are (on by
default: `--set sync.center_clip=0` for none, as before it was built).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_baseline import build_rows  # noqa: E402
from diloco.config import parse_assignments  # noqa: E402
from diloco.coordinator import centered_clip, delta_sample, limits, merging, pusher_watch  # noqa: E402
from diloco.coordinator.service.state import NORM_HISTORY  # noqa: E402
from diloco.evaluate import eval_loss  # noqa: E402
from diloco.fragments import assign_fragments  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.model import build_model, lr_at, make_inner_optimizer  # noqa: E402
from diloco.model.contract import loss_and_metrics  # noqa: E402
from diloco.tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Fragment:
    """The syncer's side of one fragment."""

    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    version: int = 0
    open_since: int | None = None  # tick of the open round's first push
    pushes: list[tuple[int, dict[str, torch.Tensor], int, int]] = field(default_factory=list)
    history: list[dict[str, torch.Tensor]] = field(default_factory=list)  # params by version
    # --late amend: the last period's starting version and who is in it.
    period_start: int | None = None
    period_members: set[int] = field(default_factory=set)
    # The outlier check's history: accepted pushes' norms per H steps, and who pushed each.
    norms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=NORM_HISTORY))
    norm_by: collections.deque = field(default_factory=lambda: collections.deque(maxlen=NORM_HISTORY))
    # sync.center_clip: the same pushes' deviations from the mean step (who pushed each: norm_by).
    devs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=NORM_HISTORY))


def delta_norm_per_h(delta: dict[str, torch.Tensor], steps: int, H: int) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values())) / max(1.0, steps / H)


def attacked(delta, f: Fragment, steps: int, args, H: int):
    """The hostile learner's push: its own delta reversed (the model trained backwards), its norm
    just under what the outlier check takes (--attack-scale × the median of the others' recent
    norms). Until the check has history enough it pushes honestly, as a careful attacker would."""
    reference = limits.norm_reference(tuple(f.norms), tuple(map(str, f.norm_by)), str(args.hostile))
    if reference is None:
        return delta
    target = args.attack_scale * reference[0] * max(1.0, steps / H)
    size = delta_norm_per_h(delta, 1, 1)
    return {n: -d * (target / max(size, 1e-12)) for n, d in delta.items()}


@dataclass
class Watched:
    """The coordinator's watch of every learner's pushes (the clock: the tick), and after how many
    of its pushes each was first found suspect."""

    ratio_bar: float = pusher_watch.SUSPECT_RATIO
    gap_bar: float = pusher_watch.SUSPECT_GAP
    watches: dict[str, pusher_watch.PusherWatch] = field(default_factory=dict)
    pushes: collections.Counter = field(default_factory=collections.Counter)
    flagged_after: dict[str, int] = field(default_factory=dict)
    wrongly_flagged: int = 0  # judgements that found an honest learner suspect

    def add(
        self, tick: int, m: int, ratio: float | None, alignment: float | None, hostile: int, fragment: int = 0
    ) -> str:
        """One more push of learner m to `fragment`; returns why it looks hostile or broken ("":
        it does not)."""
        self.pushes[str(m)] += 1
        self.watches.setdefault(str(m), pusher_watch.PusherWatch()).add(tick, ratio, alignment, fragment)
        judged = pusher_watch.judge(self.watches, tick, math.inf, self.ratio_bar, self.gap_bar)
        for worker, judgement in judged.items():
            self.watches[worker].take(judgement)
            if judgement.reason:
                self.flagged_after.setdefault(worker, self.pushes[worker])
                self.wrongly_flagged += worker != str(hostile)
        return self.watches[str(m)].suspect

    def named(self) -> set[int]:
        return {int(w) for w in pusher_watch.named(self.watches)}

    def result(self) -> list[dict]:
        return [{**w.figures(), "suspect": w.suspect, "flagged_after_pushes": self.flagged_after.get(m),
                 "pushes": self.pushes[m]} for m, w in sorted(self.watches.items())]  # fmt: skip


def screened(
    delta,
    f: Fragment,
    m: int,
    steps: int,
    args,
    H: int,
    watched: Watched,
    tick: int,
    refuse_suspects=False,
    fragment: int = 0,
):
    """The coordinator's outlier check on one push (None: refused), or with --norm-rule clip the
    push scaled down to the bound instead; its norm joins the history once taken. With
    `refuse_suspects` a push of a learner the watch names is refused too."""
    norm = delta_norm_per_h(delta, steps, H)
    history = (tuple(f.norms), tuple(map(str, f.norm_by)), str(m))
    reference = limits.norm_reference(*history)
    ratio = norm / reference[0] if reference is not None and reference[0] > 0 else None
    suspect = watched.add(tick, m, ratio, delta_sample.alignment(delta, f.momentum), args.hostile, fragment)
    if suspect and refuse_suspects:
        return None
    if args.norm_rule == "refuse":
        if limits.norm_outlier(norm, history[0], args.norm_ratio, *history[1:]):
            return None
    elif args.norm_rule == "clip" and reference is not None:
        limit = args.norm_ratio * reference[0]
        if norm > limit:
            delta = {n: d * (limit / norm) for n, d in delta.items()}
            norm = limit
    if args.center_clip > 0:  # judged against the pushes before it; then its norm and deviation join
        delta = center_clipped(delta, f, m, steps, args, H)
    f.norms.append(norm)
    f.norm_by.append(m)
    return delta


def center_clipped(delta, f: Fragment, m: int, steps: int, args, H: int):
    """With --set sync.center_clip=K: a push whose deviation from the fragment's mean step stands
    above K × the others' median deviation pulled toward that mean step, as the coordinator does
    (coordinator/centered_clip.py; the deviation here over every entry, not from a sampled cosine)."""
    mean_step = {n: f.momentum[n] * (1 - args.mu) for n in delta}
    dev = delta_norm_per_h({n: delta[n] - mean_step[n] for n in delta}, steps, H)
    share, _ = centered_clip.kept_share(
        dev, tuple(f.devs), tuple(map(str, f.norm_by)), str(m), args.center_clip
    )
    f.devs.append(dev)
    if share < 1:
        args.clipped[m] = args.clipped.get(m, 0) + 1
        delta = {n: d.clone() for n, d in delta.items()}
        centered_clip.pull_toward(delta, f.momentum, args.mu, share)
    return delta


def close_rounds(frags, args, M, policy, tick, merges, single, force=False, refused=frozenset()):
    """Close every round whose every learner pushed, or with quorum once its window is over. The
    `refused` learners (named, with sync.refuse_suspects) are not waited for, nor a share, as in
    the coordinator."""
    for f in frags:
        pushers = {m for m, *_ in f.pushes}
        members = M - len(set(refused) - pushers)
        needed = members if args.quorum <= 0 else min(args.quorum, members)
        if not f.pushes:
            continue
        if (
            not force
            and len(pushers) < members
            and (len(pushers) < needed or tick < f.open_since + args.window)
        ):
            continue
        acc = merging.MergeAccumulator(policy.merge)
        for _, delta, tok, st in f.pushes:
            acc.add(delta, merging.merge_weight(tok, st, policy.merge))
        scale = 1.0 if args.no_coverage else merging.coverage_scale(len(pushers), members)
        # The merger's rule: the momentum moves by the round's share of a full round's steps.
        work = merging.work_fraction(sum(st for *_, st in f.pushes), members, args.inner_steps)
        fraction = 1.0 if args.late == "amend" else (scale if args.no_coverage else work)
        f.period_start, f.period_members = f.version, set(pushers)
        lr, mu = merging.outer_hyper(
            policy.outer_lr, policy.outer_momentum, policy.outer_warmup_rounds, f.version
        )
        f.params, f.momentum = merging.outer_step(f.params, f.momentum, acc.result(scale), lr, mu, policy.nesterov,
                                                 fraction=fraction)  # fmt: skip
        f.version += 1
        f.history.append({n: t.clone() for n, t in f.params.items()})
        merges += 1
        single += len(pushers) < members
        f.pushes, f.open_since = [], None
    return merges, single


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--offsets", default="", help="comma-separated start delay in steps per learner")
    p.add_argument("--tokens", type=int, default=1_228_800)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--overlap", type=int, default=10, help="τ: steps from a push to its merge's apply")
    p.add_argument("--quorum", type=int, default=1, help="0: every learner")
    p.add_argument("--window", type=int, default=0, help="steps a round waits past quorum")
    p.add_argument("--no-coverage", action="store_true", help="a partial round takes a full outer step")
    p.add_argument("--apply", choices=["own", "latest"], default="own",
                   help="apply the merge that used the push, or the newest version at apply time")  # fmt: skip
    p.add_argument("--late", choices=["round", "amend"], default="round",
                   help="a push late for the last period: its own round, or amended into that period's step")  # fmt: skip
    p.add_argument("--hostile", type=int, default=-1,
                   help="this learner pushes its delta reversed, at --attack-scale x the others' median norm")  # fmt: skip
    p.add_argument(
        "--attack-scale", type=float, default=9.9, help="under the refusal bar (sync.max_delta_norm_ratio 10)"
    )
    p.add_argument("--norm-rule", choices=["refuse", "clip", "none"], default="refuse",
                   help="a push over --norm-ratio x the median: refused (the coordinator's rule), or clipped to it")  # fmt: skip
    p.add_argument(
        "--norm-ratio", type=float, default=10.0, help="the coordinator's sync.max_delta_norm_ratio"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    cfg = (
        default_run_config()
        .with_overrides({"train.seed": args.seed, "train.inner_steps": args.inner_steps, "train.threads": 1})
        .with_overrides(parse_assignments(args.overrides))
        .validate()
    )
    torch.set_num_threads(args.threads)
    M, H, P, tau = args.learners, args.inner_steps, args.fragments, args.overlap
    offsets = [int(x) for x in args.offsets.split(",")] if args.offsets else [0] * M
    bs = cfg.train.batch_size
    tokens_per_step = bs * (cfg.model.seq_len + 1)
    steps_each = args.tokens // (M * tokens_per_step)
    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    train_rows, eval_rows = build_rows(cfg, vocab, steps_each * M * bs, 16 * bs)
    policy = dataclasses.replace(cfg.sync, quorum=args.quorum)
    args.mu, args.center_clip, args.clipped = policy.outer_momentum, cfg.sync.center_clip, {}

    models = [build_model(cfg.model, vocab, cfg.train.seed) for _ in range(M)]
    optims = [make_inner_optimizer(m, cfg.train) for m in models]
    plan = assign_fragments([(n, t.numel()) for n, t in models[0].named_parameters()], P)
    start = dict(models[0].named_parameters())
    frags = [
        Fragment({n: start[n].detach().clone() for n in ns}, {n: torch.zeros_like(start[n]) for n in ns})
        for ns in plan
    ]
    for f in frags:
        f.history.append({n: t.clone() for n, t in f.params.items()})
    # Per learner and fragment: (base version, steps since receipt, pending apply tick, version to apply).
    base = [[0] * P for _ in range(M)]
    since = [[0] * P for _ in range(M)]
    apply_at: list[list[tuple[int, int] | None]] = [[None] * P for _ in range(M)]
    interval = H // P
    done = [0] * M
    merges = single = 0
    refused = [0] * M  # pushes refused, by learner
    watched = Watched(cfg.sync.suspect_norm_ratio, cfg.sync.suspect_alignment_gap)
    tick = 0
    while min(done) < steps_each:
        for m in range(M):
            if tick < offsets[m] or done[m] >= steps_each:
                continue
            rows = train_rows[(done[m] * M + m) * bs : (done[m] * M + m + 1) * bs]
            block = torch.from_numpy(rows.astype("int64"))
            for g in optims[m].param_groups:
                g["lr"] = lr_at(done[m], cfg.train)
            loss, _ = loss_and_metrics(models[m]({"input_ids": block}), "the model")
            optims[m].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[m].parameters(), cfg.train.grad_clip)
            optims[m].step()
            done[m] += 1
            params = dict(models[m].named_parameters())
            for q in range(P):
                since[m][q] += 1
            # Apply what is due (the merge that used our push, or the newest version).
            for q in range(P):
                due = apply_at[m][q]
                if due is not None and done[m] >= due[0] and frags[q].version >= due[1]:
                    v = frags[q].version if args.apply == "latest" else due[1]
                    with torch.no_grad():
                        for n, t in frags[q].history[v].items():
                            params[n].copy_(t)
                    base[m][q], since[m][q], apply_at[m][q] = v, 0, None
            if done[m] % interval == 0:
                q = (done[m] // interval - 1) % P
                if apply_at[m][q] is None and since[m][q]:
                    delta = {n: frags[q].history[base[m][q]][n] - params[n].detach() for n in plan[q]}
                    f = frags[q]
                    if (
                        args.late == "amend"
                        and f.period_start is not None
                        and base[m][q] >= f.period_start
                        and m not in f.period_members
                        and all(pm != m for pm, *_ in f.pushes)
                    ):
                        # Late for the last period: its share goes into that period's outer step.
                        mu, lr = policy.outer_momentum, policy.outer_lr
                        for n, d in delta.items():
                            g = d / M
                            f.momentum[n] = f.momentum[n] + g
                            f.params[n] = f.params[n] - lr * (g + mu * g)
                        f.version += 1
                        f.history.append({n: t.clone() for n, t in f.params.items()})
                        f.period_members.add(m)
                        apply_at[m][q] = (done[m] + tau, f.version)
                        continue
                    if m == args.hostile:
                        delta = attacked(delta, f, since[m][q], args, H)
                    delta = screened(
                        delta, f, m, since[m][q], args, H, watched, tick, cfg.sync.refuse_suspects, q
                    )
                    if delta is None:  # refused: as the learner does, it takes the fragment as it is now
                        refused[m] += 1
                        apply_at[m][q] = (done[m] + tau, f.version)
                        continue
                    f.pushes.append((m, delta, since[m][q] * tokens_per_step, since[m][q]))
                    if f.open_since is None:
                        f.open_since = tick
                    apply_at[m][q] = (done[m] + tau, f.version + 1)
        refusing = watched.named() if cfg.sync.refuse_suspects else set()
        merges, single = close_rounds(frags, args, M, policy, tick, merges, single, refused=refusing)
        tick += 1
    # The end: every learner hands in what it has not pushed (as the real learner's flush does).
    for m in range(M):
        params = dict(models[m].named_parameters())
        for q in range(P):
            if apply_at[m][q] is None and since[m][q]:
                delta = {n: frags[q].history[base[m][q]][n] - params[n].detach() for n in plan[q]}
                if m == args.hostile:
                    delta = attacked(delta, frags[q], since[m][q], args, H)
                delta = screened(
                    delta, frags[q], m, since[m][q], args, H, watched, tick, cfg.sync.refuse_suspects, q
                )
                if delta is None:
                    refused[m] += 1
                    continue
                frags[q].pushes.append((m, delta, since[m][q] * tokens_per_step, since[m][q]))
    refusing = watched.named() if cfg.sync.refuse_suspects else set()
    merges, single = close_rounds(frags, args, M, policy, tick, merges, single, force=True, refused=refusing)
    final = build_model(cfg.model, vocab, cfg.train.seed)
    with torch.no_grad():
        own = dict(final.named_parameters())
        for f in frags:
            for n, t in f.params.items():
                own[n].copy_(t)
    loss = eval_loss(final, eval_rows, bs, "cpu")
    result = {"eval_loss": loss, "merges": merges, "partial_merges": single, "refused": sum(refused), "refused_by_learner": refused, "steps_each": steps_each,
              "watch": watched.result(), "wrongly_flagged": watched.wrongly_flagged, "center_clipped": args.clipped,
              "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
