"""The publisher thread: merged heads are checkpointed and committed; the pull codec's chain."""

from __future__ import annotations

import time

import torch

from diloco.coordinator import checkpoint
from diloco.coordinator.service.base import ServiceBase
from diloco.coordinator.service.state import (
    FragmentState,
    log,
    moving_average,
)
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire import steps

GIVE_UP_AT_SHUTDOWN_AFTER = 5  # failures in a row


def publish_pause(started: float, now: float, min_interval_s: float) -> float:
    """Seconds to wait before the next publish began at `started` may start.

    Under a burst of merges the checkpoints are spaced out: the merges in between are published
    together, one file and one commit (ingest + merge ran 48% -> 55% of raw streaming in
    benchmarks/ingest.py). When merges are sparse this waits for nothing.
    """
    return max(0.0, min_interval_s - (now - started))


def publish_retry(failures: int, *, stopping: bool) -> float | None:
    """Seconds before trying again after `failures` failed publishes in a row (exponential, at
    most 5 s); None: give up, which happens only at shutdown, never while the run goes on."""
    if stopping and failures >= GIVE_UP_AT_SHUTDOWN_AFTER:
        return None
    return min(5.0, 0.2 * 2**failures)


class Publisher(ServiceBase):
    def _publish_forever(self) -> None:
        """Checkpoint and commit merges off the RPC threads, every waiting merge at once."""
        failures = 0
        while True:
            with self.cond:
                ready = [(f, f.params, f.momentum, f.version) for f in self.fragments if f.unpublished]
                if not ready:
                    if self._stop.is_set():
                        return
                    self.cond.wait(0.25)
                    continue
            try:
                started = time.monotonic()
                for frag, params, momentum, version in ready:
                    self._publish(frag, params, momentum, version)
                failures = 0
                self.publish_failing = None
                self.published_at = self.clock()
                pause = publish_pause(
                    started, time.monotonic(), self.config.coordinator.min_publish_interval_s
                )
                if pause > 0:
                    self._stop.wait(pause)
            except Exception as e:  # a store hiccup: the merges stay in memory and are tried again
                failures += 1
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                if self.publish_failing is None:
                    # Since when, and why: status shows it, and a job's supervisor stops on it.
                    self.publish_failing = (self.clock(), why)
                    log.exception("publishing merges failed; retrying")
                else:  # the traceback once; then a line (a full disk fails every few seconds)
                    self.publish_failing = (self.publish_failing[0], why)
                    log.error("publishing merges failed (%d in a row): %s; retrying", failures, why)
                retry = publish_retry(failures, stopping=self._stop.is_set())
                if retry is None:
                    log.error("giving up publishing at shutdown: the last merges are lost")
                    return
                time.sleep(retry)

    def _publish(
        self,
        frag: FragmentState,
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor],
        version: int,
    ) -> None:
        started = time.monotonic()
        p = frag.index
        # The file is complete on the store before the ledger points at it.
        checkpoint.save_fragment(self.checkpoint_root, p, version, params, momentum)
        with self.cond:
            merges = [m for m in frag.unpublished if m.version <= version]
            self.ledger.commit_merges(p, merges)
            frag.unpublished = [m for m in frag.unpublished if m.version > version]
            self._extend_broadcast(frag, params, version)
            frag.published_version = version
            frag.files.append(version)
            # The version before the published one stays as a fallback (keep_versions: 0 keeps all).
            keep = self.config.coordinator.keep_versions
            obsolete, frag.files = (frag.files[:-keep], frag.files[-keep:]) if keep else ([], frag.files)
            self.cond.notify_all()
        merged = int(self.ledger.counter("tokens_merged"))
        for m in merges:
            self.events.record(
                "merge", fragment=p, version=m.version, pushes=len(m.push_ids), tokens=m.tokens,
                mean_loss=m.mean_loss, reason=m.reason, tokens_merged=merged,
            )  # fmt: skip
        for old in obsolete:
            checkpoint.remove_fragment(self.checkpoint_root, p, old)
        elapsed = time.monotonic() - started
        self.publish_time_s = moving_average(self.publish_time_s, elapsed)
        if len(merges) > 1:
            log.info("published fragment=%d version=%d (%d merges at once)", p, version, len(merges))

    def _extend_broadcast(self, frag: FragmentState, params: dict[str, torch.Tensor], version: int) -> None:
        """On publishing `version`: what learners will hold next, and the encoded step there."""
        codec = self.config.sync.pull_codec
        if codec == "fp32":
            frag.broadcast = params
            return
        blobs, frag.broadcast = steps.encode_steps(
            params, frag.broadcast, codec, self.config.sync.codec_level
        )
        frag.chain[version] = (frag.published_version, blobs)
        for old in sorted(frag.chain)[: -self.config.sync.pull_chain]:
            del frag.chain[old]

    def _pull_groups(self, p: int, have: int) -> list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]:
        """What a learner holding version `have` of fragment p needs: the encoded steps since, or
        (no version held, or the steps are gone) the full fragment as learners hold it."""
        frag = self.fragments[p]
        codec = self.config.sync.pull_codec
        chain = (
            steps.steps_since(frag.chain, frag.published_version, have)
            if codec != "fp32" and have >= 0
            else None
        )
        # An empty chain (the learner holds the latest already) is sent whole too: a learner whose
        # push was refused asks for any version, and must get one. (Seen: an int8-pull learner
        # pulled nothing back, over and over, while a quorum-2 round waited for its next push.)
        if chain:
            return [
                (
                    pb.TensorHeader(fragment=p, version=v, delta=True, codec=codec),
                    {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in blobs.items()},
                )
                for v, blobs in chain
            ]
        return [(pb.TensorHeader(fragment=p, version=frag.published_version, codec="fp32"), frag.broadcast)]
