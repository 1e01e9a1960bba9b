"""One configuration object for the whole run, as plain data.

It is loaded from TOML, overridden by CLI flags, stored by the coordinator, and handed to every
worker at join (as JSON), so all roles train with the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.config_checks import check
from diloco.config_parse import (
    ConfigError,
    build,
    flatten,
    is_table,
    literal,
    parse_assignments,
    read_toml,
    toml_value,
    unknown_key,
)

__all__ = ["ConfigError", "RunConfig", "parse_assignments"]


@dataclass
class ModelConfig:
    """What the learners train: the nn.Module a factory builds, and the rows it reads.

    `factory` names a function installed where the learner runs ("package.module:function"); it
    is called with `kwargs` (plus `vocab_size` and `seq_len` below, when it takes parameters of
    those names and `kwargs` does not set them) and returns the nn.Module. Code never travels: the
    coordinator knows the model only as named tensors. The default is the built-in GPT.
    """

    factory: str = "diloco.model.gpt:gpt"
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The vocabulary a token model needs; 0 means: take it from the tokenizer.
    vocab_size: int = 0
    # Tokens per packed row (a row holds seq_len + 1, for the shifted targets).
    seq_len: int = 128
    # Start from these parameters instead of a random init: a safetensors file (path or URI) of the
    # model's state, e.g. a finished run's model.safetensors. DiLoCo's large H wants a warm start.
    init_from: str = ""


@dataclass
class DataConfig:
    """Where raw data lives, how it is cut into chunks and turned into shards."""

    # A directory, glob, single file, or "stdlib" (the embedded default corpus).
    dataset: str = "stdlib"
    # Where processed shards are written; "" means <workdir>/shards.
    store: str = ""
    chunk_bytes: int = 64 * 1024 * 1024
    # Field holding the text in .jsonl records (and the column of .parquet files).
    text_field: str = "text"
    # "" tokenizes and packs text (input_ids). "package.module:function": the user's preprocess,
    # run by data workers on batches of records (any file kind: images, .csv, .npy/.npz, parquet,
    # JSONL, text), returning named fixed-shape arrays; the ledger then counts samples, not tokens.
    preprocess: str = ""
    # An image dataset's class names in label order (a label is its folder's index here). Empty:
    # the class folders' sorted names, recorded at the run's first start, so a label means the same
    # class in every data worker, in `diloco eval --dataset` on a subset, and in an export.
    classes: list[str] = field(default_factory=list)
    # Records (JSONL lines, parquet values) larger than this are skipped and counted.
    max_record_bytes: int = 8 * 1024 * 1024
    # "byte" (256 byte values + end-of-text) or a path/URI of a HF tokenizer.json.
    tokenizer: str = "byte"
    # Share of chunks held out for evaluation (never leased to learners).
    eval_fraction: float = 0.05
    # Passes over the train split: each train chunk is made into a shard and trained this many
    # times (a small image or tabular dataset wants several; a corpus, one).
    epochs: int = 1
    # Learner-side queue of prefetched batches, in batches.
    prefetch_batches: int = 64
    # Hand chunks and shards out in a random order (seeded by train.seed), not the dataset's.
    shuffle: bool = True
    # Shards a learner draws batches from at once, at random: its H steps see several parts of
    # the corpus, not one file's worth. Each open shard is held decoded in memory.
    mix_shards: int = 4
    # Deal train shards round-robin over this many learner slots (0: first come, first served):
    # a fault-free run then trains every learner on the same rows in the same order every time,
    # and only a failure changes who trains what. `diloco run` sets it to --learners.
    deal: int = 0
    # Data workers stop taking train chunks while this many train shards are made (or being made)
    # and no learner has started them (0: no limit, make everything as fast as possible). Where
    # data workers share the learners' cores, making the whole corpus ahead takes the learners'
    # time; `diloco run` sets it to a few shards per learner.
    max_ready_shards: int = 0
    # Learner-side copy of shards read from the store (LRU, checksum-verified): "" caches in the
    # per-user cache dir, and only shards on a remote store (a local one gains nothing from a
    # copy); a directory caches every shard there; "off" never caches.
    cache_dir: str = ""
    # Most bytes the shard cache keeps (0: off).
    cache_bytes: int = 2 << 30

    @property
    def unit(self) -> str:
        """What the run counts: samples for a preprocess's shards, tokens for packed text."""
        return "samples" if self.preprocess else "tokens"


@dataclass
class TrainConfig:
    """The learner's inner loop."""

    batch_size: int = 16
    inner_steps: int = 50  # H: inner AdamW steps between syncs of a fragment
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # Token budget over all learners (0: until data or time runs out).
    max_tokens: int = 0
    # "auto" picks cuda when available, else cpu.
    device: str = "auto"
    # torch intra-op threads per learner (0: leave torch's default).
    threads: int = 0
    seed: int = 1337
    # Injected delay per inner step, for straggler experiments (seconds).
    step_delay_s: float = 0.0
    # A learner with a stable id keeps its state (parameters, inner optimizer, unmerged rows,
    # bases) on its own disk this often, off the training thread: restarted, it goes on from
    # there instead of losing every step since its last pushes (0: never).
    local_state_every_s: float = 2.0
    # ...and no more often than keeps the copies' cost (the training thread's copy, the writer's
    # save and fsync) within this share of the time: a large model copies less often.
    local_state_max_share: float = 0.05
    # Inner-step arithmetic: "auto" is bf16 autocast on CUDA and fp32 elsewhere; "bf16" | "fp32".
    precision: str = "auto"
    # torch.compile the model for its inner steps (the first steps pay for the compile).
    compile: bool = False


@dataclass
class SyncConfig:
    """The outer loop: how learners push fragments and how the coordinator's syncer merges them.

    The defaults are Decoupled DiLoCo (minimum quorum 1, two fragments, overlapped application).
    Synchronous DiLoCo is quorum = 0 (every live learner), fragments = 1, overlap_steps = 0.
    """

    # Minimum quorum K: pushes a round needs before it may close. 0 means every live learner.
    quorum: int = 1
    # P: parameter fragments; one is pushed every inner_steps / P steps, round-robin.
    fragments: int = 2
    # τ: inner steps between a push and the application of its merged result. 0: the learner waits
    # for the merge (synchronous); > 0: it keeps training and applies the result when due, or when
    # it comes if later (it never waits). Every step trained between a push and its merge starts
    # from a point the merge has moved, so a small τ costs least: measured with 2 learners, eval
    # loss at τ = 10 / 5 / 2 (means of 3 seeds) was 2.0258 / 2.0051 / 1.9675 for a tiny Llama at
    # H = 20 (synchronous DiLoCo 1.9613) and 2.0954 / 2.0816 / 2.0713 for the 2-layer GPT at
    # H = 50 (sync 2.0872); with 4 and 8 learners and at H = 100 τ = 2 and 10 were within noise
    # (README, results/quality_tau2.json). A slow link's merge comes late whatever τ is; `diloco
    # tune` sizes τ to the round trip there.
    overlap_steps: int = 2
    # α: on application θ ← α·θ_local + (1 − α)·Θ_merged (0: overwrite).
    mix_alpha: float = 0.0
    # Keep the steps trained between a push and its merge: θ_p ← Θ_p + (θ_p − θ_p at the push).
    # Off, they are overwritten (Streaming DiLoCo and torchft with α = 0): with τ = 10 at H = 50 a
    # fifth of every fragment's inner steps, and more when a grace window delays the merge. On, a
    # later merge costs only staleness, so the grace window can wait long enough for learners
    # to meet in one round. Ignored when mix_alpha > 0.
    keep_overlap: bool = True
    merge: str = "token"  # mean | token | rda
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    # Merges of a fragment over which the outer step goes from plain averaging (lr 1, no momentum)
    # to (outer_lr, outer_momentum), linearly (merging.outer_hyper). Early pseudo-gradients point
    # the same way round after round, and a momentum buffer fed with them overshoots. Measured at
    # 5-25 outer steps (2-layer GPT, M x H in 2x50..8x50, 3 seeds; a tiny Llama): 10 brought sync
    # DiLoCo from 1.062 to 1.042 x DDP and Decoupled from 1.050 to 1.042 (mean of five cells), the
    # Llama from 1.09 to 1.00; a long run spends only its first merges on it. 0: no warm-up.
    outer_warmup_rounds: int = 10
    # How many versions behind the fragment's current one a push may be based on and still merge.
    max_staleness: int = 16
    # σ: a push based `lag` versions behind its round's enters the merge scaled by σ ** lag (its
    # weight in the normaliser unchanged; merging.age_factor). 1: stale pushes count in full.
    # Measured on the 8 chaos pairs (2 learners, kills every 5-30 s; 0-6 of 25-37 merged pushes
    # stale): σ = 0.5 gave +0.90% mean, +2.59% worst against +0.39%, +2.89% at 1, within noise.
    stale_decay: float = 1.0
    # A delta whose norm is more than this many times the median of the fragment's last accepted
    # ones (scaled by its steps over H) is refused as an outlier: one broken or hostile learner
    # cannot throw the model away. 0: no check. Needs a few accepted deltas first.
    max_delta_norm_ratio: float = 10.0
    # The pusher watch (coordinator/pusher_watch.py) names a learner whose last pushes' median norm
    # stands above suspect_norm_ratio x the others', whose mean cosine to the outer momentum stands
    # suspect_alignment_gap from the live learners' median, or whose reported training loss stands
    # above the others' by suspect_loss_excess x the run's first loss (0: that rule off). A named
    # learner is judged on its pushes since (6 at least), against pusher_watch.RELEASE (3/4) of each bar.
    suspect_norm_ratio: float = 2.0
    suspect_alignment_gap: float = 0.35
    suspect_loss_excess: float = 0.75
    # ... or whose recent deltas' median cosine to the other learners' own directions stands this
    # far below their median cosine to one another (coordinator/agreement.py; 0: that rule off).
    suspect_disagreement: float = 0.7
    # Refuse a named learner's pushes (its rows left to train) until it no longer looks hostile or
    # broken: still watched while refused, so an honest learner named by mistake comes back. On:
    # only named, a learner climbing the loss took eval 2.18 to 35-60 (benchmarks/hostile_learner.py).
    refuse_suspects: bool = True
    # A taken delta whose deviation from the fragment's mean step ((1 - outer_momentum) x its
    # momentum) stands above center_clip x the median of the other workers' recent deviations is
    # pulled toward that mean step until it stands there (coordinator/centered_clip.py): a learner
    # inside the norm bound can no longer take the model far the wrong way. 0: off. Honest GPT
    # pushes came to 1.86x, the digits CNN's to 4.2x (1-3 of ~100 a run above 3); a reversed
    # learner at 9.9x the median norm took outer_sim's eval to 2.65 / 2.60 at 3 (2.93 / 2.94 off,
    # 2.50 / 2.49 at 2, where 16-19% of the digits pushes are clipped: benchmarks/results/center_clip*).
    center_clip: float = 3.0
    # A round of short pushes (a restarted learner's first, the end game's last few steps) enters
    # the outer step scaled by 2ρ/(1 + ρ²), ρ its pushes' steps over H (merging.short_push_scale):
    # a short delta is mostly the inner loop's fluctuation, which does not shrink with its steps.
    # Measured in chaos runs (2 learners, H = 50): a round of 18 steps of fragment 1 had 2.7× a whole
    # round's outer-gradient norm per step, and that merge alone took the eval from 2.331 to 2.356.
    # "none": coverage alone. A fragment's first merge (plain averaging) is never scaled.
    short_push_scale: str = "balanced"  # balanced | none
    # γ: the adaptive grace window after quorum is γ·(G·step_time − time_to_quorum − sync_time),
    # G = max(τ, grace_steps) (none when τ = 0). The first pusher's merge may then come after its
    # τ steps: it never waits for it (it applies the merge when it comes, keeping the steps since
    # its push), so the price of a longer window is staleness, and the gain is rounds that hold
    # every learner (measured: 0.8 left 25–75% of quorum-1 rounds with one push of two learners,
    # 3 left 0–17%).
    grace_factor: float = 3.0
    # G's floor: the first pusher's inner steps a round may spend gathering the others' pushes.
    # It was τ itself while τ was 10; at τ = 2 the window shrank with it and rounds came apart
    # (4 learners, H = 50: 6–11 of 26–35 rounds held one push, against 0–1 of 15–18 at τ = 10).
    grace_steps: int = 10
    # A learner stops stepping only when the syncer has been unreachable for this long (0: never).
    max_unreachable_s: float = 300.0
    # Longest a learner long-polls for a new version before asking again (seconds).
    pull_wait_s: float = 10.0
    # How deltas travel: fp32 (raw), or bf16 / int8 / int4 (blockwise absmax) then zstd.
    codec: str = "fp32"
    codec_level: int = 3
    # Learners keep what quantization dropped and send it with the next delta of that fragment.
    error_feedback: bool = True
    # How merged fragments go back: fp32 (the full fragment), or bf16 / int8 / int4 deltas against
    # the version the learner holds (the coordinator keeps the error feedback).
    pull_codec: str = "fp32"
    # Encoded deltas kept per fragment; a learner further behind gets the full fragment.
    pull_chain: int = 32

    @property
    def synchronous(self) -> bool:
        return self.overlap_steps == 0

    @property
    def gather_steps(self) -> int:
        """G: a first pusher's inner steps of slack a round may spend waiting for more pushes
        (0 when synchronous: every live learner is in the round, and each waits for it)."""
        return 0 if self.synchronous else max(self.overlap_steps, self.grace_steps)


@dataclass
class CoordinatorConfig:
    """Leases, membership and message limits."""

    lease_ttl_s: float = 30.0
    heartbeat_s: float = 3.0
    # Bytes of tensor data per streamed message; well below max_message_bytes.
    stream_chunk_bytes: int = 1 << 20
    max_message_bytes: int = 8 << 20
    # A delta push larger than this is refused (guards memory against a broken client).
    max_push_bytes: int = 2 << 30
    grpc_workers: int = 64
    # A chunk that fails this many times is quarantined.
    max_chunk_attempts: int = 3
    # Pushes received at once; more wait (and are told to retry): memory stays bounded.
    max_inflight_pushes: int = 16
    # A push stream that stalls is cancelled and gives its slot back: silent this long between
    # two messages, or streaming longer than push_base_s + its declared bytes at push_min_bytes_per_s.
    push_idle_s: float = 30.0
    push_base_s: float = 60.0
    push_min_bytes_per_s: float = float(1 << 20)
    # Checkpoints are written at most this often; merges in between are published together.
    min_publish_interval_s: float = 0.25
    # Checkpoint files kept per fragment: the published version and the ones before it (at least
    # 2: the one before is the fallback of a reader that read the ledger just before a commit). 0
    # keeps every version, a fragment's size (and its momentum) per publish: the run's history,
    # for `benchmarks/merge_evals.py` to evaluate the model after every merge.
    keep_versions: int = 2
    # Live workers of one role at most: a join beyond is refused. Fake learners that join and
    # heartbeat would otherwise each shrink every honest round's coverage (and fill the ledger).
    max_workers_per_role: int = 1024
    # Per caller (its certificate under mutual TLS, else its host; see coordinator/callers.py):
    # live workers it may register (a host, in token and plaintext mode: a certificate is one
    # worker, its name), pushes it may have open (in a slot or waiting for one), and pulls it may
    # have waiting for a new version. 0: no cap. Without them one machine could join fake
    # learners, or hold every push slot and handler thread.
    max_workers_per_caller: int = 64
    # A worker gone (left or lost) this long that holds nothing in the ledger (no lease ever, no
    # push, evaluation or report: an id that only joined) is deleted from it; 0: kept for good.
    forget_workers_after_s: float = 3600.0
    # Chunk and shard leases one worker holds at once; beyond, it is told to wait. A learner holds
    # the shards whose rows it trained but has not pushed yet: H steps' worth, a few shards.
    max_leases_per_worker: int = 256
    max_pushes_per_caller: int = 8
    max_waiting_pulls_per_caller: int = 16
    # Long-poll pulls waiting at once, all callers together: kept below grpc_workers so joins,
    # heartbeats and leases always find a handler thread; a pull beyond is told to retry.
    max_waiting_pulls: int = 32
    # RPCs running or queued at once; gRPC answers RESOURCE_EXHAUSTED beyond (clients retry).
    max_concurrent_rpcs: int = 512
    # A completed shard is read back and checked (rows, tokens, checksum: a hash of its stored
    # bytes) before it becomes ready; off, the data workers' reports are taken as they come.
    verify_shards: bool = True


@dataclass
class EvalConfig:
    """The held-out loss of the published global model while the run trains (an evaluator role,
    `diloco evaluator`; `diloco run` starts one): a curve beside the learners' training loss."""

    # Seconds between evaluations, of a model that changed since the last one; 0: by merges only.
    every_s: float = 30.0
    # Or (also) after this many merges, every fragment's counted, since the last evaluation; 0: by time.
    every_merges: int = 0
    # Rows evaluated: the first max_batches × train.batch_size rows of the held-out split, in
    # chunk order, the same rows every time.
    max_batches: int = 16
    # The final evaluation of `diloco run` reads the first final_batches batches of the same rows
    # (the figure its summary reports), and a token model then writes a sample of sample_tokens
    # tokens (0: none). On a CPU a large model's final evaluation takes minutes: fewer batches, a
    # noisier figure, an earlier end.
    final_batches: int = 64
    sample_tokens: int = 200
    # A model with running statistics (BatchNorm) has them recomputed for the global weights before
    # it is evaluated or exported: a cumulative mean over the first recalibrate_batches ×
    # train.batch_size rows of the train split, in chunk order; 0: the merged statistics as they are.
    recalibrate_batches: int = 32
    # The evaluator's CPU threads (it shares the machine with learners).
    threads: int = 1


@dataclass
class RunConfig:
    name: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self) -> str:
        lines: list[str] = []
        top = {k: v for k, v in self.to_dict().items() if not isinstance(v, dict)}
        for key, value in top.items():
            lines.append(f"{key} = {toml_value(value)}")
        for section, values in self.to_dict().items():
            if isinstance(values, dict):
                lines.append(f"\n[{section}]")
                lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return build(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(read_toml(path))

    def merged_with_toml(self, path: str | Path) -> RunConfig:
        """This config with the keys a TOML file sets replaced (unknown keys are refused)."""
        return self.with_overrides(flatten(read_toml(path)))

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """Apply dotted overrides such as {"train.inner_steps": 100}; None values are ignored."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            if value is None:
                continue
            *parents, leaf = dotted.split(".")
            node = data
            for p in parents:
                if p not in node or not isinstance(node[p], dict):
                    raise ConfigError(f"unknown config section {p!r} in {dotted!r}")
                node = node[p]
            if leaf not in node and not is_table(parents):
                raise ConfigError(unknown_key(dotted))
            node[leaf] = literal(value) if is_table(parents) else value
        return RunConfig.from_dict(data)

    def validate(self) -> RunConfig:
        """This config, once every value is one the run can use (else a ConfigError saying which)."""
        check(self)
        return self
