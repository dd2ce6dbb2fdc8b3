"""Who records each step of a live job, and who records the step a killed writer applied
(dtrain.ft.live.job.LiveMembership), over a stand-in for LiveReplicas that states each
step's quorum: the processes and the store are tests/ft/test_live.py's."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.ft.live.job import LiveMembership
from dtrain.ft.membership import Fixed


@dataclass
class Quorums:
    """What LiveMembership reads of a LiveReplicas: this replica's id, and the last step's
    quorum (its members, those of them that held the state when it formed, and whether
    this replica applied the step)."""

    replica_id: int
    slots: int = 3
    committed: bool = False
    members: tuple[int, ...] = ()
    continuing: tuple[int, ...] = ()

    def begin_step(self, step: int) -> int:
        return step


def _steps(replica_id: int, quorums: list[tuple[tuple[int, ...], tuple[int, ...]]]
           ) -> list[tuple[bool, bool]]:
    """(writes, took over) of replica `replica_id` at each step whose quorum is (members,
    continuing); a replica not among the members was dropped from that step."""
    live = Quorums(replica_id)
    membership = LiveMembership(live, step_timeout=5.0)  # type: ignore[arg-type]
    seen = []
    for step, (members, continuing) in enumerate(quorums, start=1):
        membership.begin_step(step)
        live.members, live.continuing = members, continuing
        live.committed = replica_id in members
        seen.append((membership.writes(), membership.took_over()))
    return seen


def test_the_first_live_replica_that_held_the_state_writes_each_step() -> None:
    """Replica 0 writes while it lives; killed after step 2, replica 1 writes step 3 and
    takes over (the record of step 2 may be missing); at step 3 replica 0's replacement is
    sent the state (not continuing), so replica 1 still writes; from step 4 replica 0
    writes again, taking over from no one (replica 1, the last writer, is still there)."""
    quorums = [((0, 1, 2), (0,)),          # the first step: replica 0 the source
               ((0, 1, 2), (0, 1, 2)),
               ((0, 1, 2), (1, 2)),        # 0 killed after step 2, its replacement joins
               ((0, 1, 2), (0, 1, 2)),
               ((1, 2), (1, 2))]           # 0 gone again, no replacement yet
    assert _steps(0, quorums)[:4] == [(True, False), (True, False), (False, False),
                                      (True, False)]
    assert _steps(1, quorums) == [(False, False), (False, False), (True, True),
                                  (False, False), (True, True)]
    assert _steps(2, quorums) == [(False, False)] * 5


def test_a_replica_dropped_from_a_step_neither_writes_nor_takes_over_after() -> None:
    """Replica 0 dropped from step 2 (its state stale until it recovers) writes neither
    step 2 nor, sent the state at step 3, step 3: replica 1 does both, taking over at
    step 2 only; replica 0 holds no record of the steps before its return."""
    quorums = [((0, 1), (0,)), ((1,), (1,)), ((0, 1), (1,)), ((0, 1), (0, 1))]
    assert _steps(0, quorums) == [(True, False), (False, False), (False, False),
                                  (True, False)]
    assert _steps(1, quorums) == [(False, False), (True, True), (True, False),
                                  (False, False)]


def test_fixed_membership_writes_every_step_and_never_takes_over() -> None:
    fixed = Fixed()
    assert (fixed.writes(), fixed.took_over(), fixed.worlds, fixed.steady) == (True, False, 1,
                                                                                True)
