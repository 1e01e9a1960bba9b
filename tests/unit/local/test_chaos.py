"""The chaos supervisor's choices: seeded, and every role is hit once per cycle; the monkey that
carries them out keeps spares once, kills only when due, never while the job finishes."""

from __future__ import annotations

import signal
import statistics
from dataclasses import dataclass, field

from diloco.local.chaos import CHAOS_ROLES, ChaosMonkey, ChaosPlan


def test_every_cycle_hits_each_live_role_once() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=1)
    roles = ["coordinator", "data", "learner", "learner", "learner"]
    picks = [plan.pick_role(roles) for _ in range(30)]
    for cycle in range(10):
        assert sorted(picks[3 * cycle : 3 * cycle + 3]) == ["coordinator", "data", "learner"]


def test_roles_without_live_processes_are_skipped() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=2)
    assert plan.pick_role(["coordinator", "data", "learner"]) in {"coordinator", "data", "learner"}
    # The data workers have finished: the bag refills without them.
    picks = {plan.pick_role(["coordinator", "learner"]) for _ in range(6)}
    assert picks == {"coordinator", "learner"}
    assert plan.pick_role([]) is None


def test_same_seed_same_chaos() -> None:
    a, b = ChaosPlan(3.0, seed=7), ChaosPlan(3.0, seed=7)
    roles = ["coordinator", "data", "learner"]
    assert [(a.pick_role(roles), a.next_delay()) for _ in range(10)] == [
        (b.pick_role(roles), b.next_delay()) for _ in range(10)
    ]


def test_delays_average_the_interval_and_have_a_floor() -> None:
    plan = ChaosPlan(interval_s=4.0, seed=3)
    delays = [plan.next_delay() for _ in range(4000)]
    assert min(delays) >= 0.5
    assert 3.7 < statistics.mean(delays) < 4.4


def test_roles_filter_limits_the_victims() -> None:
    plan = ChaosPlan(interval_s=5.0, seed=4, roles=("learner",))
    picks = {plan.pick_role(["coordinator", "data", "learner"]) for _ in range(12)}
    assert picks == {"learner"}
    assert plan.pick_role(["coordinator", "data"]) is None


@dataclass
class Proc:
    name: str
    role: str
    alive: bool = True


@dataclass
class Group:
    """What ChaosMonkey asks of a ProcessGroup, recorded."""

    children: list[Proc] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)

    def keep_spares(self, roles: list[str], per_role: int) -> None:
        self.calls.append(("spares", tuple(roles), per_role))

    def signal(self, child: Proc, sig: int) -> None:
        self.calls.append(("signal", child.name, sig))
        child.alive = False

    def wait(self, children: list[Proc], timeout_s: float) -> bool:
        return True

    def respawn(self, child: Proc) -> Proc:
        self.children.remove(child)
        self.children.append(again := Proc(child.name, child.role))
        self.calls.append(("respawn", child.name))
        return again


def test_the_monkey_keeps_spares_once_kills_when_due_and_not_while_the_job_finishes() -> None:
    now = [100.0]
    group = Group([Proc("coordinator", "coordinator"), Proc("data-0", "data"), Proc("learner-0", "learner"),
                   Proc("learner-1", "learner"), Proc("evaluator", "evaluator")])  # fmt: skip
    monkey = ChaosMonkey(ChaosPlan(5.0, seed=1, roles=CHAOS_ROLES), group, say=lambda _: None,
                         clock=lambda: now[0])  # fmt: skip
    monkey.start(now[0])
    first = monkey.next_kill
    monkey.tick(now[0], training=False, finishing=False)
    assert group.calls == []  # not training yet, no kill due: no spare starts beside the job's start
    monkey.tick(now[0], training=True, finishing=False)
    assert group.calls == [("spares", CHAOS_ROLES, 2)]
    monkey.tick(first - 0.01, training=True, finishing=False)
    assert len(group.calls) == 1  # spares once; the kill not due yet
    kills = 0
    for _ in range(9):  # three cycles of the role bag
        now[0] = monkey.next_kill
        monkey.tick(now[0], training=True, finishing=False)
        kills += 1
        assert monkey.next_kill > now[0]
    killed = [c for c in group.calls if c[0] == "signal"]
    assert len(killed) == kills == sum(monkey.kills.values()) == len(monkey.kill_log)
    assert all(sig == signal.SIGKILL for _, _, sig in killed)
    assert monkey.kills == {"coordinator": 3, "data": 3, "learner": 3}  # never the evaluator
    assert sum(1 for c in group.calls if c[0] == "respawn") == kills
    now[0] = monkey.next_kill + 60
    monkey.tick(now[0], training=True, finishing=True)
    assert sum(monkey.kills.values()) == kills  # the job is finishing: nothing more is killed


def test_a_learner_of_several_ranks_gets_no_spare() -> None:
    group = Group([Proc("learner-0", "learner"), Proc("data-0", "data")])
    monkey = ChaosMonkey(ChaosPlan(5.0, seed=2, roles=CHAOS_ROLES), group, say=lambda _: None,
                         spare_learners=False)  # fmt: skip
    monkey.start(0.0)
    monkey.tick(0.0, training=True, finishing=False)
    assert group.calls[0] == ("spares", ("coordinator", "data"), 2)
