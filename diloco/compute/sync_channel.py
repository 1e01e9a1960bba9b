"""The learner's line to the syncer, off the training thread.

A pusher thread streams queued fragment deltas; a puller thread long-polls for the merged
fragments that answer them. The training loop only submits jobs and picks up results: it never
waits on the network (unless it chooses to, in synchronous mode). A push the syncer refuses (too
stale) is answered by the fragment's current global version, which the learner takes and goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from diloco.client import CoordinatorClient, backoff_delay
from diloco.compute.rpc_outcome import Action, Outcome, rpc_outcome
from diloco.errors import DilocoError
from diloco.v1 import coordinator_pb2 as pb

log = logging.getLogger("diloco.sync")


@dataclass
class PushJob:
    header: pb.TensorHeader
    tensors: dict[str, torch.Tensor]
    number: int = 0  # the learner's count of submitted pushes, this one included


@dataclass
class Merged:
    """A fragment's global value, to apply: the merge that used our push, or the current one.

    Either its full value (`parts` is one group with delta False), or the encoded steps from the
    version the learner holds (groups with delta True, one per version, in order).
    """

    fragment: int
    version: int
    parts: list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]
    accepted: bool  # False: our push was refused; this is the fragment as it is now

    @classmethod
    def full(
        cls, fragment: int, version: int, tensors: dict[str, torch.Tensor], accepted: bool = True
    ) -> Merged:
        return cls(
            fragment, version, [(pb.TensorHeader(fragment=fragment, version=version), tensors)], accepted
        )


class SyncChannel:
    def __init__(
        self,
        client: CoordinatorClient,
        stop: threading.Event,
        pull_wait_s: float,
        held: Callable[[int], int],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client = client
        self.clock = clock  # what unreachable_for counts in (tests move it by hand)
        self.held = held  # fragment -> the version the learner holds (deltas start there)
        self.stop = stop
        self.pull_wait_s = pull_wait_s
        self.jobs: queue.Queue[PushJob] = queue.Queue()
        self._cond = threading.Condition()
        # fragment -> (version the merge must exceed, accepted, the push): kept until the merge is
        # back, so a push can be asked about again after a coordinator restart.
        self._awaiting: dict[int, tuple[int, bool, PushJob]] = {}
        self._results: dict[int, Merged] = {}
        self.finishing = threading.Event()  # a push reply said the run is finishing
        self._missed: list[tuple[int, float]] = []  # (push number, seconds it missed a round by)
        self.submitted = 0
        self._unreachable_since: float | None = None
        # Set once the coordinator refuses this learner for good (rpc_outcome's FATAL): the
        # learner ends with it (check) instead of training on with nothing of it merged.
        self.refused: DilocoError | None = None
        self.pushes_refused = 0
        self.bytes_pushed = 0
        self._threads = [
            threading.Thread(target=self._push_forever, name="sync-push", daemon=True),
            threading.Thread(target=self._pull_forever, name="sync-pull", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        """After `stop`: wait for both threads, so none is inside gRPC or torch at exit."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    # -- the training thread's side -------------------------------------------------------------

    def submit(self, header: pb.TensorHeader, tensors: dict[str, torch.Tensor]) -> int:
        """Queue a push; returns its number (pushes are numbered from 1 in submission order)."""
        self.submitted += 1
        self.jobs.put(PushJob(header, tensors, self.submitted))
        return self.submitted

    def take(self, fragment: int) -> Merged | None:
        with self._cond:
            return self._results.pop(fragment, None)

    def take_missed(self, after: int) -> float:
        """Seconds by which pushes numbered above `after` missed the others' rounds (0: none).

        Pushes made before the learner last moved its schedule measured the old schedule: what
        they missed by is already made up, and counting it again would overshoot."""
        with self._cond:
            missed = max((s for n, s in self._missed if n > after), default=0.0)
            self._missed = []
            return missed

    def wait_any(self, timeout_s: float) -> None:
        """Sleep until a result arrives (or the timeout): synchronous mode's only wait.
        Raises the channel's refusal (check): a merge waited for would never come."""
        with self._cond:
            if not self._results and self.refused is None:
                self._cond.wait(timeout_s)
        self.check()

    def check(self) -> None:
        """Raise the coordinator's refusal of this learner, once there is one: the learner's
        loop calls this each step, so it ends with that line (a DilocoError) at once."""
        if self.refused is not None:
            raise self.refused

    def coordinator_restarted(self) -> None:
        """A new coordinator epoch: pushes that were waiting for a merge may have been dropped.

        Each is sent again with its own push_id. The ledger answers for it: merged (we get the
        merge), or dropped with the restart (refused: we take the current fragment and go on).
        Nothing is applied twice.
        """
        with self._cond:
            jobs = [job for _, accepted, job in self._awaiting.values() if accepted]
            for job in jobs:
                del self._awaiting[job.header.fragment]
        for job in jobs:
            log.info("coordinator restarted: asking again about the push of fragment %d", job.header.fragment)
            self.jobs.put(job)

    def unreachable_for(self) -> float:
        since = self._unreachable_since
        return 0.0 if since is None else self.clock() - since

    def idle(self) -> bool:
        with self._cond:
            return self.jobs.unfinished_tasks == 0 and not self._awaiting

    # -- background threads ---------------------------------------------------------------------

    def _reachable(self, ok: bool) -> None:
        if ok:
            self._unreachable_since = None
        elif self._unreachable_since is None:
            self._unreachable_since = self.clock()

    def _give_up(self, what: str, outcome: Outcome) -> None:
        """The coordinator refuses this learner for good: keep the first reason, wake the learner."""
        with self._cond:
            if self.refused is None:
                # Said by the learner, which ends on it (Learner.run logs it and leaves).
                self.refused = DilocoError(f"the coordinator refuses this learner's {what}: {outcome.reason}")
            self._cond.notify_all()

    def _push_forever(self) -> None:
        while not self.stop.is_set():
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if self.refused is None:  # refused for good: the queue drains, so idle() holds
                    self._push_one(job)
            finally:
                self.jobs.task_done()

    def _push_one(self, job: PushJob) -> None:
        p = job.header.fragment
        attempt = 0
        reply: pb.PushReply | None = None
        # A closed client (the learner is stopping) ends the retries: its calls can only fail.
        while reply is None and not self.stop.is_set() and not self.client.closed:
            try:
                # Tried once: this loop is the retry, and it must hear of an outage at once (a
                # client retrying under it would hide one for its whole deadline).
                reply = self.client.push(job.header, job.tensors, retry_for_s=0)
                self._reachable(True)
            except grpc.RpcError as e:
                # The same push_id on every retry: if a reply was lost, nothing happens twice.
                outcome = rpc_outcome(e.code(), e.details())
                self._reachable(outcome.reachable)
                if outcome.action is Action.FATAL:
                    self._give_up("pushes", outcome)
                    return
                if outcome.action is Action.MALFORMED:
                    log.error("push of fragment %d %s", p, outcome.reason)
                    reply = pb.PushReply(accepted=False, reason=e.details(), version=job.header.version)
                    break
                log.warning("push of fragment %d failed (%s); retrying", p, outcome.reason)
            except Exception:  # the thread must survive anything; the learner depends on it
                if self.client.closed:
                    break
                log.exception("push of fragment %d failed; retrying", p)
            if reply is None:
                self.stop.wait(backoff_delay(attempt))
                attempt += 1
        if reply is None:
            return
        if reply.run_state in (pb.RUN_STATE_FINISHING, pb.RUN_STATE_FINISHED):
            self.finishing.set()
        if not reply.accepted:
            self.pushes_refused += 1
            log.info("push of fragment %d refused: %s", p, reply.reason)
        elif reply.missed_round_by_s > 0:
            with self._cond:
                self._missed.append((job.number, reply.missed_round_by_s))
        if not job.tensors:
            return  # "nothing this round" (or rows given back): no merge to wait for
        with self._cond:
            # Accepted: the merge that includes us makes a version above reply.version.
            # Refused: any version will do (we take the current one and go on).
            self._awaiting[p] = (reply.version if reply.accepted else -1, bool(reply.accepted), job)
            self._cond.notify_all()

    def _pull_forever(self) -> None:
        attempt = 0
        while not self.stop.is_set():
            with self._cond:
                if not self._awaiting:
                    self._cond.wait(0.2)
                    continue
                wanted = dict(self._awaiting)
            fragments = sorted(wanted)
            try:
                got = self.client.pull(
                    fragments,
                    [self.held(p) for p in fragments],
                    self.pull_wait_s,
                    [wanted[p][0] for p in fragments],
                    retry_for_s=0,  # this loop is the retry (see _push_one)
                )
                self._reachable(True)
                attempt = 0
            except Exception as e:  # the thread must survive anything; the learner depends on it
                if self.client.closed:
                    return
                # Not a gRPC status (a broken stream's content): the coordinator answered.
                outcome = rpc_outcome(e.code(), e.details()) if isinstance(e, grpc.RpcError) else None
                self._reachable(outcome is None or outcome.reachable)
                if outcome is not None and outcome.action is Action.FATAL:
                    self._give_up("pulls", outcome)
                    return
                # MALFORMED too is tried again: what is wanted changes as pushes are answered.
                log.warning("pull failed (%s); retrying", e if outcome is None else outcome.reason)
                self.stop.wait(backoff_delay(attempt))
                attempt += 1
                continue
            by_fragment: dict[int, list[tuple[pb.TensorHeader, dict[str, torch.Tensor]]]] = {}
            for header, tensors in got:
                by_fragment.setdefault(header.fragment, []).append((header, tensors))
            with self._cond:
                for p, parts in by_fragment.items():
                    if p in self._awaiting:
                        accepted = self._awaiting.pop(p)[1]
                        self._results[p] = Merged(p, parts[-1][0].version, parts, accepted)
                if got:
                    self._cond.notify_all()
            if not got:  # the long poll ran out (or, a defect, answered nothing at once): no busy loop
                self.stop.wait(0.05)
