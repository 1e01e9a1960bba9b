"""The coordinator's Prometheus metrics (prometheus-client), by Prometheus naming conventions.

Most figures are read from the status detail at scrape time (a custom collector: one source for
`diloco status`, the page and Prometheus, nothing counted twice); what only an event can tell —
how long a push or pull took, how many bytes it carried, why a push was refused — is observed as
it happens, in histograms and counters. Each coordinator has a registry of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Bytes from a few KB (a small fragment, int4) to GBs (a large model's fragment in fp32).
BYTE_BUCKETS = tuple(float(4**k) for k in range(5, 17))
# A delta's norm over the outlier check's reference: honest runs measured 0.3 to 6.9 (warm-up:
# the learning rate and the deltas grow round by round), refused above sync.max_delta_norm_ratio.
NORM_RATIO_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 100.0)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
AUDIT_EVERY_S = 60.0
# The ledger meta key the transfer sums and counts are kept under across coordinator lives.
TRANSFER_COUNTS = "transfer_counts"


class CoordinatorMetrics:
    """The registry a coordinator serves, with the event metrics its handlers observe."""

    def __init__(self, detail: Callable[[], dict[str, Any]], workdir: str | Path | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        # Every PushDelta call, from its first piece to the reply: those that carried tensors, and
        # "nothing this round" or "shards released" pushes that carried none.
        self.push_seconds = Histogram(
            "diloco_push_seconds",
            "Time to receive one delta push call (with tensors or without), first piece to reply",
            buckets=SECONDS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # Only the pushes that carried tensors: its count can be below push_seconds' count.
        self.push_bytes = Histogram(
            "diloco_push_bytes", "Tensor bytes of one delta push that carried tensors, as encoded on the wire",
            buckets=BYTE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # How close honest pushes come to the outlier bar, before anyone lowers it (pushes with a
        # reference only: the first few of a fragment have none).
        self.push_norm_ratio = Histogram(
            "diloco_push_norm_ratio",
            "A delta's norm per H steps over the median of other workers' recent ones (the outlier "
            "check's reference); refused above sync.max_delta_norm_ratio",
            buckets=NORM_RATIO_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.pull_seconds = Histogram(
            "diloco_pull_seconds", "Time to stream one pull's fragments (long-poll wait excluded)",
            ["role"], buckets=SECONDS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.pull_bytes = Histogram(
            "diloco_pull_bytes", "Tensor bytes of one pull", ["role"], buckets=BYTE_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.pushes_refused = Counter(
            "diloco_pushes_refused", "Delta pushes refused, by reason", ["reason"], registry=self.registry
        )
        self.calls_refused = Counter(
            "diloco_calls_refused", "Calls refused for their identity (token, role, worker id)", ["rpc"],
            registry=self.registry,
        )  # fmt: skip
        # Every known label value at 0 from the start: increase() and rate() then see the first
        # refusal (a series that first appears at 1 reads as no increase).
        for reason in known_push_refusals():
            self.pushes_refused.labels(reason=reason)
        for rpc in known_rpcs():
            self.calls_refused.labels(rpc=rpc)
        # Earlier coordinator lives' transfer sums and counts (restore_transfers): the run's
        # transfers are every life's, as its wire bytes are.
        self._earlier: dict[str, float] = {}
        self._earlier_lock = threading.Lock()
        self.transfers_restored = False
        self.registry.register(StatusCollector(detail, workdir))

    def _this_life(self) -> dict[str, float]:
        """This life's sums and counts of the transfer histograms: {"<name>_sum", "<name>_count"}."""
        out: dict[str, float] = {}
        for name, histogram, labels in (
            ("push", self.push_seconds, {}), ("push_bytes", self.push_bytes, {}),
            ("pull", self.pull_seconds, {"role": "compute"}), ("pull_bytes", self.pull_bytes, {"role": "compute"}),
        ):  # fmt: skip
            total = count = 0.0
            for metric in histogram.collect():
                for sample in metric.samples:
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        total += sample.value if sample.name.endswith("_sum") else 0.0
                        count += sample.value if sample.name.endswith("_count") else 0.0
            out[f"{name}_sum"], out[f"{name}_count"] = total, count
        return out

    def transfer_counts(self) -> dict[str, float]:
        """Every life's transfer sums and counts so far: what the ledger keeps (TRANSFER_COUNTS)
        for the next life to restore."""
        with self._earlier_lock:
            earlier = dict(self._earlier)
        now = self._this_life()
        return {k: now[k] + float(earlier.get(k, 0.0)) for k in now}

    def restore_transfers(self, saved: dict[str, float] | None) -> None:
        """Add earlier lives' counts (transfer_counts'), once per life: later calls do nothing."""
        with self._earlier_lock:
            if self.transfers_restored:
                return
            self.transfers_restored = True
            for k, v in (saved or {}).items():
                self._earlier[str(k)] = self._earlier.get(str(k), 0.0) + float(v)

    def transfers(self) -> dict[str, float]:
        """Mean seconds and bytes of one push and of one learner pull over the run (every
        coordinator life whose counts were restored), for status and the summary.

        `pushes`: PushDelta calls timed (push_seconds_mean is over them), tensor-less ones
        included; `pushes_with_tensors`: those that carried tensors (push_bytes_mean is over
        them); `pulls`: learner pulls (pull_seconds_mean and pull_bytes_mean are over them)."""
        c = self.transfer_counts()

        def mean(name: str) -> float:
            return round(c[f"{name}_sum"] / c[f"{name}_count"], 6) if c[f"{name}_count"] else 0.0

        return {
            "push_seconds_mean": mean("push"),
            "pushes": int(c["push_count"]),
            "push_bytes_mean": mean("push_bytes"),
            "pushes_with_tensors": int(c["push_bytes_count"]),
            "pull_seconds_mean": mean("pull"),
            "pulls": int(c["pull_count"]),
            "pull_bytes_mean": mean("pull_bytes"),
        }

    def refused(self, reason: str) -> None:
        # The reason's first words: a label, not a message (versions and numbers left out).
        self.pushes_refused.labels(reason=reason_label(reason)).inc()


def known_push_refusals() -> list[str]:
    """The labels of the refusals a push can get (reason_label of each), for series at 0."""
    from diloco.coordinator.pusher_watch import SUSPECT_REFUSAL
    from diloco.coordinator.syncer import staleness_refusal

    reasons = [
        staleness_refusal(0, 0, 1), staleness_refusal(0, 2, 1), "stalled stream", "malformed",
        "spans of this push overlap each other", "span 1:[0,1) is not inside a known shard",
        SUSPECT_REFUSAL,
    ]  # fmt: skip
    return sorted({reason_label(r) for r in reasons if r})


def known_rpcs() -> list[str]:
    """The coordinator's RPC names, as the guard labels a refused call."""
    from diloco.v1 import coordinator_pb2 as pb

    return sorted(m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods)


def reason_label(reason: str) -> str:
    words = [w for w in reason.replace(":", " ").replace(",", " ").split() if not any(c.isdigit() for c in w)]
    return "_".join(words[:4]).lower() or "unknown"


class StatusCollector(Collector):
    """Gauges and counters from the coordinator's status detail, read when scraped."""

    def __init__(self, detail: Callable[[], dict[str, Any]], workdir: str | Path | None):
        self.detail = detail
        self.workdir = workdir
        self._audit: tuple[float, bool] | None = None

    def describe(self) -> list[Metric]:
        return []  # the families depend on the run (its learners); none is declared ahead

    def collect(self) -> Iterator[Metric]:
        d = self.detail()
        now = time.monotonic()
        state = GaugeMetricFamily("diloco_run_state", "1 for the run's state", labels=["state"])
        for s in ("running", "finishing", "finished"):
            state.add_metric([s], 1.0 if d["run_state"] == s else 0.0)
        yield state
        yield GaugeMetricFamily(
            "diloco_coordinator_epoch",
            "Coordinator starts so far (restarts = epoch - 1)",
            value=d["coordinator_epoch"],
        )
        yield GaugeMetricFamily("diloco_coordinator_uptime_seconds", "Since this start", value=d["uptime_s"])
        for key, what in (
            ("prepared", "made into shards by data workers"),
            ("leased", "in train shards handed to learners"),
            ("trained", "trained by learners (their reports)"),
            ("merged", "merged into the global model, each once"),
        ):
            yield CounterMetricFamily(
                f"diloco_tokens_{key}", f"Tokens (or samples) {what}", value=d.get(f"tokens_{key}", 0)
            )
        versions = GaugeMetricFamily("diloco_fragment_version", "Published version", labels=["fragment"])
        merges = CounterMetricFamily(
            "diloco_merges", "Merges (outer steps) of a fragment", labels=["fragment"]
        )
        for p, v in enumerate(d["fragment_versions"]):
            versions.add_metric([str(p)], v)
            merges.add_metric([str(p)], v)
        yield versions
        yield merges
        yield CounterMetricFamily("diloco_rounds", "Rounds merged, every fragment", value=d["rounds"])
        yield CounterMetricFamily(
            "diloco_pushes_accepted", "Delta pushes taken into a round", value=d["pushes_received"]
        )
        yield CounterMetricFamily(
            "diloco_pushes_center_clipped",
            "Taken pushes pulled toward the fragment's mean step (sync.center_clip)",
            value=d.get("pushes_center_clipped", 0),
        )
        wire = CounterMetricFamily(
            "diloco_wire_bytes", "Bytes on the wire by RPC", labels=["rpc", "direction"]
        )
        for rpc, counts in sorted(d.get("wire_by_rpc", {}).items()):
            wire.add_metric([rpc, "received"], counts.get("received", 0))
            wire.add_metric([rpc, "sent"], counts.get("sent", 0))
        yield wire
        yield from self._chunks(d)
        yield from self._workers(d)
        yield from self._eval(d)
        audit_ok = self._audit_ok(now)
        if audit_ok is not None:
            yield GaugeMetricFamily(
                "diloco_audit_ok",
                "1 when the ledger's promises hold (checked each minute)",
                value=float(audit_ok),
            )

    @staticmethod
    def _chunks(d: dict[str, Any]) -> Iterator[Metric]:
        chunks = GaugeMetricFamily("diloco_chunks", "Raw chunks by state", labels=["state"])
        for s, n in sorted(d.get("chunks_by_state", {}).items()):
            chunks.add_metric([s], n)
        yield chunks
        yield GaugeMetricFamily(
            "diloco_chunks_quarantined",
            "Chunks given up on after repeated failures",
            value=d["chunks_quarantined"],
        )
        yield GaugeMetricFamily("diloco_shards", "Shards recorded", value=d["shards_total"])

    @staticmethod
    def _workers(d: dict[str, Any]) -> Iterator[Metric]:
        up = GaugeMetricFamily("diloco_worker_up", "1 while a worker heartbeats", labels=["worker", "role"])
        util = GaugeMetricFamily(
            "diloco_learner_utilization_ratio", "Share of a learner's time in inner steps", labels=["worker"]
        )
        stall = GaugeMetricFamily(
            "diloco_learner_data_stall_ratio", "Share of a learner's time waiting for data", labels=["worker"]
        )
        loss = GaugeMetricFamily(
            "diloco_learner_inner_loss", "A learner's last inner-step loss", labels=["worker"]
        )
        age = GaugeMetricFamily(
            "diloco_learner_last_push_age_seconds", "Since a learner's last push", labels=["worker"]
        )
        lag = GaugeMetricFamily(
            "diloco_learner_version_lag",
            "Versions a learner's last push was behind its fragment",
            labels=["worker"],
        )
        trained = CounterMetricFamily(
            # Not diloco_learner_tokens_trained: the learner's own /metrics serves that name.
            "diloco_learner_life_tokens_trained",
            "Tokens a learner trained in its current life, as its heartbeats told the coordinator",
            labels=["worker"],
        )
        ratio = GaugeMetricFamily(
            "diloco_learner_delta_norm_ratio",
            "Median of a learner's last delta norms over the other workers' median", labels=["worker"],
        )  # fmt: skip
        alignment = GaugeMetricFamily(
            "diloco_learner_delta_alignment",
            "Mean cosine of a learner's last deltas to their fragments' outer momentum", labels=["worker"],
        )  # fmt: skip
        excess = GaugeMetricFamily(
            "diloco_learner_loss_excess",
            "A learner's reported training loss above the other learners', over the run's first loss",
            labels=["worker"],
        )
        suspect = GaugeMetricFamily(
            "diloco_learner_suspect",
            "1 while a learner's last pushes look hostile or broken",
            labels=["worker"],
        )
        data_rate = GaugeMetricFamily(
            "diloco_data_worker_tokens_per_second", "A data worker's speed while it works", labels=["worker"]
        )
        for w in d["workers"]:
            wid = w["worker_id"]
            up.add_metric([wid, w["role"]], 1.0 if w["alive"] else 0.0)
            if w["role"] == "compute":
                wall = w.get("wall_seconds") or 0.0
                util.add_metric([wid], w.get("busy_seconds", 0.0) / wall if wall else 0.0)
                stall.add_metric([wid], w.get("data_stall_seconds", 0.0) / wall if wall else 0.0)
                loss.add_metric([wid], w.get("last_loss") or 0.0)
                trained.add_metric([wid], w.get("tokens_trained", 0))
                if w.get("last_push_age_s") is not None:
                    age.add_metric([wid], w["last_push_age_s"])
                if w.get("version_lag") is not None:
                    lag.add_metric([wid], w["version_lag"])
                if w.get("delta_norm_ratio") is not None:
                    ratio.add_metric([wid], w["delta_norm_ratio"])
                if w.get("delta_alignment") is not None:
                    alignment.add_metric([wid], w["delta_alignment"])
                if w.get("loss_excess") is not None:
                    excess.add_metric([wid], w["loss_excess"])
                suspect.add_metric([wid], 1.0 if w.get("suspect") else 0.0)
            elif w["role"] == "data":
                data_rate.add_metric([wid], w.get("tokens_per_s", 0.0))
        yield from (up, util, stall, loss, age, lag, ratio, alignment, excess, suspect, trained, data_rate)

    @staticmethod
    def _eval(d: dict[str, Any]) -> Iterator[Metric]:
        evals = d.get("evals") or []
        if not evals:
            return
        last = evals[-1]
        yield GaugeMetricFamily(
            "diloco_eval_loss", "Held-out loss of the latest evaluated global model", value=last["loss"]
        )
        metric = GaugeMetricFamily("diloco_eval_metric", "The model's own held-out metrics", labels=["name"])
        for name, value in sorted(last.get("metrics", {}).items()):
            metric.add_metric([name], value)
        yield metric

    def _audit_ok(self, now: float) -> bool | None:
        if self.workdir is None:
            return None
        if self._audit is None or now - self._audit[0] >= AUDIT_EVERY_S:
            from diloco.coordinator.audit import audit

            self._audit = (now, audit(self.workdir, check_files=False).ok)
        return self._audit[1]
