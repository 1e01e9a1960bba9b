"""The service's core: its state, life cycle (the merger, publisher and ticker threads), the
parameters it loads at start, and the helpers every handler uses; the budget ticker."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import deque

import grpc
import torch

from diloco.config import RunConfig
from diloco.coordinator import checkpoint, lifecycle, merging, pusher_watch, syncer
from diloco.coordinator.agreement import Agreement
from diloco.coordinator.callers import (
    HEARTBEAT_BURST,
    Callers,
    Rates,
    RefusalLog,
    caller_of,
    heartbeat_rate,
    peer_host,
)
from diloco.coordinator.delta_sample import Sketcher
from diloco.coordinator.held_out import no_eval_split_warning
from diloco.coordinator.init_check import RunModel
from diloco.coordinator.ledger import Ledger
from diloco.coordinator.log_text import loggable
from diloco.coordinator.pusher_watch import PusherWatch
from diloco.coordinator.report import tokens_reported
from diloco.coordinator.service.state import (
    NORM_HISTORY,
    RUN_STATES,
    FragmentState,
    RoundSum,
    log,
)
from diloco.coordinator.wirecount import WIRE_COUNTS, WireCounter
from diloco.fragments import assign_fragments
from diloco.observe.events import RunEvents
from diloco.observe.prometheus import TRANSFER_COUNTS, CoordinatorMetrics
from diloco.security.revocation import RevocationList
from diloco.v1 import coordinator_pb2 as pb

# After a restart, how long (in learner heartbeats) a fragment's first round waits for the pushes
# the restart dropped: a learner sends them again at its first heartbeat to the new epoch.
RESEND_WAIT_HEARTBEATS = 2.0
# Chunk completions a waiting data worker's next ask is paced by (chunks.retry_after_s).
CHUNK_PACE_WINDOW = 8


class ServiceBase:
    def __init__(
        self,
        config: RunConfig,
        ledger: Ledger,
        checkpoint_root: str,
        shard_root: str,
        tokenizer_hash: str = "",
        events: RunEvents | None = None,
        workdir: str | None = None,
    ):
        self.config = config
        self.ledger = ledger
        # Handed out at join; every worker refuses to work with a tokenizer that differs.
        self.tokenizer_hash = tokenizer_hash
        self.run_id = self.ledger.run_id()
        self.checkpoint_root = checkpoint_root
        self.shard_root = shard_root
        self.clock = ledger.clock  # one clock for the coordinator: tests move the ledger's
        self.policy = config.sync  # what the syncer's decisions read
        self.cond = threading.Condition(threading.RLock())
        self.wire = WireCounter()
        # The run's wire bytes go on across coordinator lives (saved every progress sample): a
        # chaos run that restarts its coordinator once under-counted them by each life's.
        self.wire.restore(json.loads(ledger.get_meta(WIRE_COUNTS) or "{}"))
        # What happened, for metrics.jsonl, TensorBoard and the page; Prometheus reads status.
        self.events = events or RunEvents(None)
        self.metrics = CoordinatorMetrics(self.status_detail, workdir)
        # The transfer histograms' counts too go on across lives (status's `transfers`).
        self.metrics.restore_transfers(json.loads(ledger.get_meta(TRANSFER_COUNTS) or "{}"))
        self.workdir = workdir
        self._progress_at: tuple[float, int, int] | None = None  # (monotonic, merged, wire) sampled last
        self._ticked_at: float | None = None  # (monotonic) when the ticker's last tick ended
        self._forgot_at = time.monotonic()  # (monotonic) when gone workers were last looked for
        self.security_mode = "none"  # how callers are told apart (the server sets it)
        self.revocations: RevocationList | None = None  # the --tls-crl in force (the server sets it)
        self._roles: dict[str, str] = {}  # worker id -> role, for counting bytes per role
        self._initializing: str | None = None  # "being initialized by <worker>" while an init streams
        self.run_model = RunModel(config.model)  # the first init is checked against it (init_check)
        # Each worker's heartbeats (callers.heartbeat_rate): those faster are answered unread, from
        # its last heartbeat answered in full (its tokens_trained, the allowance it got). Made here,
        # with the service: made on first use, two first heartbeats at once could each make one.
        self._heartbeats = Rates(heartbeat_rate(config.coordinator.heartbeat_s), HEARTBEAT_BURST)
        self._allowed: dict[str, tuple[int, int | None]] = {}
        self._deal_slots: dict[str, int] = {}  # learner -> its deal slot (data.deal > 0)
        # When the last chunks completed (this life): how soon a waiting data worker asks again.
        self.chunk_completions: deque[float] = deque(maxlen=CHUNK_PACE_WINDOW)
        # (since, error) while merges cannot be saved (a full disk), else None: in status.
        self.publish_failing: tuple[float, str] | None = None
        # Refused calls: counted in memory, saved with each progress sample; logged by kind, once
        # a minute (a flood of refusals costs neither a log line nor a ledger write each).
        self._refusals_lock = threading.Lock()
        self.refusals_unsaved = 0
        self._refusal_log = RefusalLog()
        self.published_at: float | None = None  # the last merge saved (this life): stuck or not
        self._push_slots = threading.BoundedSemaphore(config.coordinator.max_inflight_pushes)
        self.callers = Callers(ledger)  # which caller holds each worker id, and its open calls
        self._budget_lock = threading.Lock()  # one learner's allowance is read and written at a time
        self._dropped_by_restart = ledger.pending_pushers()  # awaited by each fragment's first round
        self.epoch = ledger.next_epoch()
        self.run_state = ledger.get_meta("run_state", "running") or "running"
        self.started_at = self.clock()
        self.fragments: list[FragmentState] = []
        self.specs: dict[str, pb.TensorSpec] = {}
        self.averaged: frozenset[str] = frozenset()  # the specs' running statistics (_install_specs)
        self.step_time_s = 0.0  # EMA of learners' reported inner step time
        # Each learner's last deltas against the run's (pusher_watch), under the lock: as the
        # ledger kept them, so that a restart does not forget whom it named. A learner's loss is
        # measured on the scale of the run's first round's (set by the first merge with a loss).
        self.loss_scale: float | None = ledger.first_loss()
        self.pusher_watch: dict[str, PusherWatch] = pusher_watch.restored(
            ledger.recent_watched(pusher_watch.WATCH_PUSHES), self.clock(), *self.watch_bars(),
            named=ledger.last_refused_as(pusher_watch.SUSPECT_REFUSAL),
        )  # fmt: skip
        # Each learner's direction against the others' (in memory: built again after a restart).
        self.sketcher, self.agreement = Sketcher(), Agreement()
        for worker_id in pusher_watch.named(self.pusher_watch):
            log.warning("learner %s still looks hostile or broken", loggable(worker_id))
        self.sync_time_s = 0.0  # EMA of merge duration
        self.publish_time_s = 0.0  # EMA of writing a checkpoint and committing its merges
        self.last_loss = math.nan
        self._load_parameters()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_forever, name="syncer-tick", daemon=True)
        self._publisher = threading.Thread(target=self._publish_forever, name="publisher", daemon=True)
        self._merger = threading.Thread(target=self._merge_forever, name="merger", daemon=True)

    # -- life cycle -----------------------------------------------------------------------------

    def watch_bars(self) -> tuple[float, float, float, float, float | None, float]:
        """What the pusher watch judges with: how long a learner counts as live, its bars, and the
        scale of losses."""
        s = self.config.sync
        return (self.config.coordinator.lease_ttl_s, s.suspect_norm_ratio, s.suspect_alignment_gap,
                s.suspect_loss_excess, self.loss_scale, s.suspect_disagreement)  # fmt: skip

    def status_detail(self) -> dict:
        raise NotImplementedError  # StatusRPCs

    def caller_refused(self, method: str, why: str, peer: str = "") -> None:
        """A call the guard refused (no identity, the wrong role, another's worker id): counted.
        `peer` (gRPC's `ipv4:HOST:PORT`) is where the logged one came from: a refusal without an
        identity names no one else."""
        with self._refusals_lock:  # counted here, written to the ledger with each progress sample
            self.refusals_unsaved += 1
        self.metrics.calls_refused.labels(rpc=method).inc()
        say, quiet = self._refusal_log.note(f"{method}: {why}", time.monotonic())
        if say:
            more = (
                f" ({quiet} more like it in the {self._refusal_log.window_s:.0f} s before)" if quiet else ""
            )
            origin = f" from {peer_host(peer)}" if peer else ""
            log.warning("refused %s%s: %s%s", method, origin, why, more)

    def _save_counts(self) -> None:
        """The counts kept in memory into the ledger: the wire bytes and the transfers' (every
        life's, restored at start) and the refusals since the last save."""
        self.ledger.set_meta(
            **{
                WIRE_COUNTS: json.dumps(self.wire.snapshot()),
                TRANSFER_COUNTS: json.dumps(self.metrics.transfer_counts()),
            }
        )
        with self._refusals_lock:
            unsaved, self.refusals_unsaved = self.refusals_unsaved, 0
        if unsaved:
            self.ledger.bump("calls_refused", unsaved)

    def start(self) -> None:
        self.events.record("start", epoch=self.epoch, run_state=self.run_state)
        # Nothing fails without a held-out split: said at every start, or first seen as no evals.
        if self.workdir is not None and (warning := no_eval_split_warning(self.workdir, self.config)):
            log.warning("%s", warning)
        self._ticker.start()
        self._merger.start()
        self._publisher.start()
        if not self.fragments:  # built off the request path, before the first learner offers its init
            self.run_model.start()

    def stop(self, publish_timeout_s: float = 60.0) -> None:
        """Stop the clocks; merges already made are published first (bounded in time)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        for thread in (self._ticker, self._merger):
            if thread.is_alive():
                thread.join(timeout=5)
        if self._publisher.is_alive():
            self._publisher.join(timeout=publish_timeout_s)
        self.run_model.join(timeout_s=30)
        with contextlib.suppress(Exception):  # a ledger closed under us: the last sample stands
            self._save_counts()
        self.events.close()

    def wait_published(self, timeout_s: float = 30.0) -> bool:
        """Until every push received so far is merged and published (for tools and tests)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(f.pending or f.unpublished for f in self.fragments):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.25))
        return True

    def _load_parameters(self) -> None:
        """After a restart: the global fragments at the versions the ledger last committed."""
        raw = self.ledger.get_meta("param_specs")
        if raw is None:
            return
        specs = [
            pb.TensorSpec(
                name=s["name"], dtype=s["dtype"], shape=s["shape"], averaged=s.get("averaged", False)
            )
            for s in json.loads(raw)
        ]
        self._install_specs(specs)
        for p, names in enumerate(self._fragment_names(specs)):
            version = self.ledger.fragment_version(p)
            params, momentum = checkpoint.load_fragment(self.checkpoint_root, p, version)
            files = checkpoint.tidy_fragment(
                self.checkpoint_root, p, version, self.config.coordinator.keep_versions
            )
            self.fragments.append(self._fragment_state(p, names, params, momentum, version, files))
        log.info("resumed fragments at versions %s", [f.version for f in self.fragments])

    def _install_specs(self, specs: list[pb.TensorSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        # Running statistics: merged as a plain mean, outside the outer step and its norm checks.
        self.averaged = frozenset(s.name for s in specs if s.averaged)

    def _fragment_names(self, specs: list[pb.TensorSpec]) -> list[list[str]]:
        sizes = [(s.name, math.prod(s.shape)) for s in specs]
        return assign_fragments(sizes, self.config.sync.fragments)

    def _fragment_state(
        self,
        p: int,
        names: list[str],
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor],
        version: int,
        files: list[int] | None = None,
    ) -> FragmentState:
        round_ = syncer.RoundState(p, version, self.clock())
        # After a restart too, a push that opens the next round hears how late it was for the
        # last one (syncer.missed_round_by), so learners knocked out of step line up again.
        # The learners whose pushes the restart dropped send them again at their next heartbeat:
        # the fragment's first round waits for them, bounded, so they merge together rather than
        # each in a round of its own (measured: those single-push rounds were the chaos runs' cost).
        awaited = self._dropped_by_restart.get(p, frozenset())
        state = FragmentState(
            p, names, params, momentum, version, round_, self._new_sum(), published_version=version,
            files=files or [version], broadcast=params, previous_round=self.ledger.round_pushers(p, version),
            awaited=awaited, awaited_until=self.clock() + RESEND_WAIT_HEARTBEATS * self.config.coordinator.heartbeat_s,
        )  # fmt: skip
        # The outlier check's and the centered clip's history, as the merged pushes of H steps or
        # more left it: a restart does not empty it.
        for worker_id, norm, deviation in self.ledger.recent_norms(
            p, NORM_HISTORY, self.config.train.inner_steps
        ):
            state.recent_norms.append(norm)
            state.recent_workers.append(worker_id)
            state.recent_deviations.append(deviation)
        return state

    def _new_sum(self) -> RoundSum:
        return RoundSum(merging.MergeAccumulator(self.policy.merge, self.averaged))

    # -- helpers --------------------------------------------------------------------------------

    def _state_pb(self) -> int:
        return RUN_STATES[self.run_state]

    def _require_worker(self, worker_id: str, context: grpc.ServicerContext, method: str) -> None:
        """A call that acts as a worker: the worker must have joined, and the caller must be the
        one that joined it (callers.py), so no one frees another's leases or pushes as it."""
        if not worker_id or not self.ledger.known_worker(worker_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {worker_id!r}: join first")
        self._require_owner(worker_id, context, method)

    def _require_owner(self, worker_id: str, context: grpc.ServicerContext, method: str) -> None:
        if problem := self.callers.acting_problem(worker_id, caller_of(context)):
            self.caller_refused(method, problem, context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)

    def _holds_enough(self, worker_id: str) -> bool:
        """Whether a worker holds its cap of leases (coordinator.max_leases_per_worker): it waits,
        so no one worker hoards the chunks or shards."""
        cap = self.config.coordinator.max_leases_per_worker
        return cap > 0 and self.ledger.leases_held(worker_id) >= cap

    def _role_of(self, worker_id: str) -> str:
        role = self._roles.get(worker_id)
        if role is None:
            role = self.ledger.worker_role(worker_id)
            if role is None:
                return "unknown"  # not kept: any caller may name any id, the map would grow
            self._roles[worker_id] = role
        return role

    def _live_learners(self) -> list[str]:
        return self.ledger.live_workers("compute", self.config.coordinator.lease_ttl_s)

    def _merging_learners(self) -> list[str]:
        """The live learners a round is for: all but those refused while named (lock held)."""
        refused = pusher_watch.refused(self.pusher_watch, self.config.sync.refuse_suspects)
        return [w for w in self._live_learners() if w not in refused]

    def _set_run_state(self, state: str, reason: str) -> None:
        with self.cond:
            if not lifecycle.may_enter(self.run_state, state):
                return
            self.run_state = state
            if state == lifecycle.FINISHING:  # why the run ends; "every learner left" comes after
                self.ledger.set_meta(run_state=state, finish_reason=reason)
            else:
                self.ledger.set_meta(run_state=state)
            log.info("run %s (%s)", state, reason)
            self.cond.notify_all()

    def _tokens_reported(self) -> int:
        """Tokens the learners say they trained (report.tokens_reported)."""
        stats = [w["stats"] for w in self.ledger.workers() if w["role"] == "compute"]
        return tokens_reported(self.ledger.counter("tokens_trained_by_earlier_lives"), stats)
