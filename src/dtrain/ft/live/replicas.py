"""Live replicas: data-parallel training that drops a dead replica and takes in a new one
without restarting anything (the idea of torchft, on the job's own store).

    live = LiveReplicas(store, replica_id=rank, slots=world_size, step_timeout=5.0)
    model = DataParallel(net, averaging=LiveAveraging(live))   # dtrain.ft.live.averaging
    optimizer = torch.optim.AdamW(model.parameters())
    live.track(optimizer=optimizer, save_extra=lambda: {"seen": seen},
               load_extra=lambda extra: ...)
    step = 0
    while step < steps:
        step = live.begin_step(step)   # the quorum for this step; a joiner is sent the state
        loss_of(model, batch(step, live.replica_id)).backward()  # averaged over the quorum
        if live.committed:             # False only on a replica just dropped (it recovers)
            optimizer.step()
        optimizer.zero_grad()
        step += 1

A replica that dies or stalls past `step_timeout` is dropped within the step: the step is
reduced again over the survivors, from the gradients each kept, and averaged over them.
A replacement (same id, restarted, or new) is sent the model, optimizer state, step and
extra dict by a live peer over the network, and the group grows back at the next step.
No step is lost; `history` says which replicas each step averaged.

How replicas agree, through the store only (collectives just move data):
- Rounds. Replicas meet in numbered rounds: one as each step begins, and another inside a
  step whenever a reduction failed (dtrain.ft.live.rounds deletes the keys of old rounds).
  Each announces itself (`r/{g}/a/{id}`); the members of the last quorum wait for one
  another until each arrives, its heartbeat stops for `heartbeat_timeout`, or
  `step_timeout` passes, and propose the next quorum. The first proposal written
  (compare_set on `r/{g}/d`) is the decision all of them read. A replica left out of a
  decision has fallen behind: it recovers as a joiner at a later step.
- Groups. A quorum other than the last gets a new gloo group (dtrain.ft.live.group)
  whose timeout is `step_timeout`, so a stalled peer fails a collective fast.
- Votes. After a round's collective work (a reduction, a state transfer) every member
  posts ok or fail, and again the first verdict written decides for all: commit, or redo
  in a new round without whoever failed or vanished. A reduction that completed anywhere
  completed everywhere it was waited on, so members that vanished after it do not undo it.

A replica may be several ranks (`position`, `positions`: tp x pp, ZeRO inside), one
LiveReplicas each; membership is the replica's, and each position reduces on its own group.
"""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from dtrain.data_parallel.averaging import Carried
from dtrain.errors import DtrainError
from dtrain.ft.live import handover
from dtrain.ft.live.group import LiveGroup, ReplicaLost
from dtrain.ft.live.handover import LoadExtra, SaveExtra
from dtrain.ft.live.rounds import KEEP, forget, gather, rank_key, wait_key
from dtrain.ft.live.watchdog import Watchdog
from dtrain.store import prefixed
from dtrain.store.heartbeat import Heartbeat

_STORE_ERRORS = (RuntimeError, dist.DistError, ValueError)  # a store or gloo that gave up


class Outcome(enum.Enum):
    """How a step's reduction ended (`LiveReplicas.settle`)."""

    COMMIT = "commit"  # the gradients are averaged over `size` replicas
    REDO = "redo"  # a member failed: reduce again over the new, smaller group
    DROPPED = "dropped"  # this replica fell out of the quorum; it recovers at begin_step


@dataclass(frozen=True)
class Quorum:
    """One round's decision: who takes part, and who is sent the state by whom."""

    round: int
    members: list[int]
    recovering: list[int]
    source: int
    step: int
    group: int  # the round whose group it uses (a new one when it differs from the last)
    kind: str  # "step" (a step begins, joiners admitted) or "redo" (within a step)
    incarnations: dict[str, str]


@dataclass(frozen=True)
class Comparison:
    """The weights of a step's live replicas, as its first member saw them (`compare_weights`):
    who holds the same parameters as it at every position (itself included), who other
    ones (and at which positions), and who gave no digest within the step timeout (gone
    since the step)."""

    step: int
    first: int
    same: tuple[int, ...]
    other: dict[int, tuple[int, ...]]
    silent: tuple[int, ...]


class LiveReplicas:
    """Membership and recovery of data-parallel replicas that may die and be replaced.

    Args:
        store: a client of the job's store (e.g. `dist.TCPStore(host, port)`); cloned,
            so its own settings are left alone.
        replica_id: this replica's stable id in [0, slots), e.g. its launcher RANK; a
            replacement takes the id of the replica it replaces.
        slots: how many replicas the job runs when all are alive.
        position, positions: this rank's place in its replica, and the replica's ranks (a
            tp x pp group, ZeRO inside: one LiveReplicas per rank). Membership is per
            replica: one that loses any rank is dropped at every position; each position
            reduces with the same position of the other replicas.
        step_timeout: seconds a step waits for a late replica before dropping it; also the
            timeout of every collective, so it must exceed the largest difference in pace
            between replicas within a step.
        heartbeat_timeout: a replica whose heartbeat (bumped every 0.5 s) stood still this
            long is taken for dead without waiting for step_timeout.
        start_timeout: how long the first quorum waits for all `slots` replicas to come up.
        join_timeout: how long a replica outside the quorum waits to be let in.

    Raises:
        DtrainError: an argument is out of range.
    """

    def __init__(self, store: dist.Store, replica_id: int, slots: int,
                 step_timeout: float = 5.0, heartbeat_timeout: float = 2.0,
                 start_timeout: float = 60.0, join_timeout: float = 120.0,
                 position: int = 0, positions: int = 1) -> None:
        if not (0 <= replica_id < slots and 0 <= position < positions):
            raise DtrainError(f"replica_id={replica_id} must lie in [0, slots={slots}) and "
                              f"position={position} in [0, positions={positions})")
        if not 0 < heartbeat_timeout <= step_timeout:
            raise DtrainError(f"heartbeat_timeout={heartbeat_timeout} must be positive and "
                              f"at most step_timeout={step_timeout}")
        self.replica_id = replica_id
        self.slots = slots
        self.position = position
        self.positions = positions
        self._me = rank_key(replica_id, position)  # this rank's name in the store's keys
        self.step_timeout = step_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.join_timeout = join_timeout
        self._root = store
        # dist.Store.clone(), which torch's stubs leave out (as below)
        self._store = prefixed("live/", store.clone())  # type: ignore[attr-defined]
        self._beats = Heartbeat(lambda: prefixed("live/", store.clone()),  # type: ignore[attr-defined]
                                str(replica_id * positions + position), 0.5, prefix="hb/",
                                members=map(str, range(slots * positions)),
                                name=f"dtrain-live-heartbeat-{self._me}")
        self._watchdog = Watchdog(prefixed("live/", store.clone()),  # type: ignore[attr-defined]
                                  self._silent_for,
                                  self._me, heartbeat_timeout)
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.tracked = handover.Tracked()
        self._quorum: Quorum | None = None  # the last round this replica took part in,
        self._votes = 0  # and how many votes it took so far
        self._has_state = False  # holds the quorum's model (after the first transfer)
        self._broken = False  # the last verdict saw a failure: the next quorum regroups
        self._group_round = -1
        self.group: LiveGroup | None = None
        self._retired: list[tuple[float, LiveGroup]] = []  # aborted, perhaps still running
        self.step: int | None = None
        self.committed = False
        self.history: dict[int, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ what it carries
    def track(self, module: nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None,
              save_extra: SaveExtra | None = None, load_extra: LoadExtra | None = None) -> None:
        """Register what a joining replica is sent: the module (DataParallel and ZeRO do it,
        as the state they carry), the optimizer, and `save_extra()` -> a small JSON dict
        that `load_extra(dict)` restores on the joiner (e.g. the data position). Call
        before the first `begin_step`."""
        self.carry(None if module is None else Carried.of(module), optimizer, save_extra,
                   load_extra)

    def carry(self, carried: Carried | None, optimizer: torch.optim.Optimizer | None = None,
              save_extra: SaveExtra | None = None, load_extra: LoadExtra | None = None
              ) -> None:
        """`track` with the model state as its strategy carries it (`Carried`)."""
        self.tracked.update(carried, optimizer, save_extra, load_extra)

    @property
    def size(self) -> int:
        """Replicas in the current quorum (what gradients are averaged over)."""
        return 0 if self._quorum is None else len(self._quorum.members)

    @property
    def members(self) -> tuple[int, ...]:
        """Replica ids of the current quorum, in group-rank order."""
        return () if self._quorum is None else tuple(self._quorum.members)

    @property
    def continuing(self) -> tuple[int, ...]:
        """Replica ids of the current quorum that held its state when it formed (not sent
        it in this quorum: they applied the step before it, with the others)."""
        if self._quorum is None:
            return ()
        return tuple(i for i in self._quorum.members if i not in self._quorum.recovering)

    @property
    def participants(self) -> tuple[int, ...]:
        """Replica ids whose gradients the last committed step averaged."""
        return self.history[max(self.history)] if self.history else ()

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int) -> int:
        """Join this step's quorum and return the step to run: `step` itself, or on a
        replica that was (re)joining, the step its peers are at (its state, optimizer and
        extra were just replaced by theirs).

        Raises:
            DtrainError: no live replica let this one in within join_timeout.
        """
        while True:
            quorum = self._form("step", step)
            if quorum.group == self._group_round and not quorum.recovering:
                self._connect(quorum)  # the same replicas as last step: the same group
                break
            def join(q: Quorum = quorum) -> None:
                self._connect(q)
                self._transfer(q)

            ok = self._attempt(join)
            verdict = self._vote(ok, strict=True)
            if verdict["commit"] and ok:
                self._has_state = True
                break
            if verdict["commit"]:
                self._leave()
        self.step = quorum.step
        self.committed = False
        return quorum.step

    def settle(self, ok: bool) -> Outcome:
        """After this step's reduction (`ok`: it completed here), agree with the quorum on
        whether it counts. On REDO the group is already the survivors': reduce again."""
        while True:
            verdict = self._vote(ok, strict=False)
            if verdict["commit"]:
                if not ok:
                    self._leave()
                    return Outcome.DROPPED
                assert self._quorum is not None and self.step is not None
                self.history[self.step] = tuple(self._quorum.members)
                self.committed = True
                first = rank_key(self._quorum.members[0], 0)  # tidies the store
                if self._me == first and self._quorum.round >= KEEP:
                    forget(self._store, self._quorum.round - KEEP, self.slots, self.positions)
                return Outcome.COMMIT
            quorum = self._form("redo", self.step if self.step is not None else -1)
            if quorum is None:
                return Outcome.DROPPED
            def connect(q: Quorum = quorum) -> None:
                self._connect(q)

            if self._attempt(connect):
                return Outcome.REDO
            ok = False

    def compare_weights(self) -> Comparison | None:
        """Whether the live replicas of the step just committed hold the same weights: each
        rank of each posts a digest of its parameters (handover.digest) under the step; the
        step's first member, at position 0, reads them all, waiting up to `step_timeout`
        for each while it beats, and says who differs. A call every member of the step
        makes (it never blocks the others); None except on that rank, and on a replica
        that was dropped from the step or tracks no module.

        A replacement sent the wrong state (another position's experts, a stale copy)
        shows here at the next comparison, instead of as a run that drifts unseen."""
        if not self.committed or self.step is None or self.tracked.carried is None:
            return None
        members = self.history[self.step]
        step = self.step

        def key(rank: str) -> str:
            return f"w/{step}/{rank}"

        self._store.set(key(self._me), handover.digest(self.tracked.carried.trained()))
        if self._me != rank_key(members[0], 0):
            return None
        ranks = self._ranks(list(members))
        found = gather(self._store, key, ranks, time.monotonic() + self.step_timeout, None,
                       alive=self._alive)
        for rank in found:
            self._store.delete_key(key(rank))
        mine = {p: found.get(rank_key(self.replica_id, p)) for p in range(self.positions)}
        same, other, silent = [], {}, []
        for replica in members:
            theirs = {p: found.get(rank_key(replica, p)) for p in range(self.positions)}
            differ = tuple(p for p in range(self.positions)
                           if None not in (theirs[p], mine[p]) and theirs[p] != mine[p])
            if differ:
                other[replica] = differ
            elif None in theirs.values():
                silent.append(replica)
            else:
                same.append(replica)
        return Comparison(step, self.replica_id, tuple(same), other, tuple(silent))

    def finish(self) -> None:
        """Say the run is over: a replica still waiting to join stops (RunFinished)."""
        self._store.set("finished", "1")

    def close(self) -> None:
        """Stop the heartbeat and leave the group (the others drop this replica)."""
        self._watchdog.stop()
        self._beats.stop()
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ rounds
    @overload
    def _form(self, kind: Literal["step"], step: int) -> Quorum: ...
    @overload
    def _form(self, kind: Literal["redo"], step: int) -> Quorum | None: ...

    def _form(self, kind: str, step: int) -> Quorum | None:
        """Take part in rounds until one includes this replica (kind "redo": only the next
        one; None when it left this replica out)."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            g = self._next_round(deadline)
            mine = {"state": self._has_state, "step": step, "incarnation": self._incarnation}
            self._store.set(f"r/{g}/a/{self._me}", json.dumps(mine))
            if self._quorum is not None or g == 0:
                self._propose(g, kind)
            quorum = Quorum(**json.loads(self._wait_key(f"r/{g}/d", deadline, g)))
            self._store.set("latest", str(g))
            lives = quorum.incarnations.get(str(self.replica_id), "").split("|")
            if self.replica_id in quorum.members and lives[self.position] == self._incarnation:
                before = self._quorum.members if self._quorum is not None else []
                # a member new to the quorum posted its arrival in this round: alive now,
                # though its counter, silent while it was away, may not have been read since
                self._beats.heard(self._beaters([i for i in quorum.members
                                                 if i not in before]))
                self._quorum = quorum
                self._votes = 0
                return quorum
            self._leave()
            if kind == "redo":
                return None

    def _next_round(self, deadline: float) -> int:
        if self._quorum is not None:
            return self._quorum.round + 1
        g = int(self._store.get("latest")) if self._store.check(["latest"]) else 0
        while True:
            while self._store.check([f"r/{g}/d"]):
                g += 1
            if not self._store.check([f"r/{g}/a/{self._me}"]):
                return g
            # A former life of this rank announced itself in a round still open: let that
            # round close without it (its vote says fail), then look again.
            self._store.set(f"r/{g}/v0/{self._me}", "fail")
            self._wait_key(f"r/{g}/d", deadline, g)

    def _ranks(self, replicas: list[int]) -> list[str]:
        return [rank_key(i, p) for i in replicas for p in range(self.positions)]

    def _beaters(self, replicas: list[int]) -> list[str]:
        """The heartbeat names of the ranks of `replicas` (their job ranks)."""
        return [str(i * self.positions + p) for i in replicas for p in range(self.positions)]

    def _silent_for(self, replica: int) -> float:
        """Seconds since the longest-silent rank of `replica` (but this one) last beat."""
        return max(self._beats.silent_for(name) for name in self._beaters([replica]))

    def _alive(self, rank: str) -> bool:
        replica, position = (int(x) for x in rank.split("."))
        silent = self._beats.silent_for(str(replica * self.positions + position))
        return silent < self.heartbeat_timeout

    def _propose(self, g: int, kind: str) -> None:
        last = self._quorum
        if last is None:  # the very first round: wait for every slot to come up
            expected, deadline, patient = list(range(self.slots)), self.start_timeout, True
        else:
            expected, deadline, patient = last.members, self.step_timeout, False
        arrived = gather(self._store, lambda r: f"r/{g}/a/{r}", self._ranks(expected),
                         time.monotonic() + deadline, f"r/{g}/d",
                         None if patient else self._alive)
        if kind == "step" and last is not None:
            joiners = [i for i in range(self.slots) if i not in expected]
            keys = [f"r/{g}/a/{r}" for r in self._ranks(joiners)]
            for key, rank in zip(keys, self._ranks(joiners), strict=True):
                if self._store.check([key]):
                    arrived[rank] = self._store.get(key).decode()
        said = {}  # replicas all of whose ranks arrived, at one step
        for i in range(self.slots):
            posts = [arrived.get(r) for r in self._ranks([i])]
            if all(posts):
                parts = [json.loads(post) for post in posts if post]  # every one: all(posts)
                said[i] = {"state": all(q["state"] for q in parts), "step": parts[0]["step"],
                           "incarnation": "|".join(q["incarnation"] for q in parts)}
                said[i]["state"] &= all(q["step"] == parts[0]["step"] for q in parts)
        if kind == "redo":
            said = {i: a for i, a in said.items() if a["state"]}
        if not said:
            return  # nobody whole arrived: a later round (and proposer) decides
        members = sorted(said)
        holders = [i for i in members if said[i]["state"]]
        source = holders[0] if holders else members[0]
        step = said[source]["step"]
        recovering = [i for i in members if i != source
                      and (not said[i]["state"] or said[i]["step"] != step)]
        same = (last is not None and members == last.members and not recovering
                and not self._broken)
        quorum = Quorum(round=g, members=members, recovering=recovering, source=source,
                        step=step, group=last.group if same and last is not None else g,
                        kind=kind,
                        incarnations={str(i): said[i]["incarnation"] for i in members})
        self._store.compare_set(f"r/{g}/d", "", json.dumps(asdict(quorum)))

    def _vote(self, ok: bool, strict: bool) -> dict[str, bool]:
        """Post this rank's outcome of the round's work and return the verdict: commit
        unless a rank of a member failed (or, `strict`, vanished)."""
        assert self._quorum is not None
        g = self._quorum.round
        ranks = self._ranks(self._quorum.members)
        n = self._votes  # a round's transfer, then its reduction
        self._votes += 1
        if not ok:  # the watchdogs of members still blocked on the group abort it
            self._store.set(f"r/{g}/failed", self._me)
        self._store.set(f"r/{g}/v{n}/{self._me}", "ok" if ok else "fail")
        votes = gather(self._store, lambda r: f"r/{g}/v{n}/{r}", ranks,
                       time.monotonic() + self.step_timeout, f"r/{g}/c{n}", self._alive,
                       until=lambda found: "fail" in found.values())
        failed = not ok or "fail" in votes.values()
        missing = len(votes) < len(ranks)
        proposal = {"commit": not failed and not (strict and missing),
                    "broken": failed or missing}
        verdict: dict[str, bool] = json.loads(
            self._store.compare_set(f"r/{g}/c{n}", "", json.dumps(proposal)))
        self._broken = verdict["broken"]
        return verdict

    def _wait_key(self, key: str, deadline: float, g: int) -> str:
        return wait_key(self._store, key, deadline, f"replica {self.replica_id}", g,
                        self.join_timeout)

    def _leave(self) -> None:
        """This replica fell out of the quorum: its state is stale until it recovers."""
        self._quorum = None
        self._has_state = False
        self.committed = False
        self._retire()

    def _retire(self) -> None:
        """Close the current group; keep it referenced until its last collective timed out."""
        now = time.monotonic()
        self._retired = [(t, g) for t, g in self._retired if now - t < self.step_timeout + 2]
        if self.group is not None:
            self.group.close()
            self._retired.append((now, self.group))
            self.group = None
            self._group_round = -1

    # ------------------------------------------------------------------ group and state
    def _attempt(self, work: Callable[[], Any]) -> bool:
        try:
            work()
            return True
        except (ReplicaLost, *_STORE_ERRORS):
            return False

    def _connect(self, quorum: Quorum) -> None:
        """Use the quorum's group: the current one, or a new gloo group made on the store."""
        if quorum.group == self._group_round and self.group is not None:
            self._watchdog.watch(quorum.round, quorum.members, self.group)
            return
        self._retire()
        # a failed wait may leave a connection unusable (clone: not in torch's stubs)
        rendezvous = self._root.clone()  # type: ignore[attr-defined]
        timeout = timedelta(seconds=self.step_timeout)
        rendezvous.set_timeout(timeout)
        where = f"q{quorum.group}/p{self.position}"  # each position reduces on its own
        rank = quorum.members.index(self.replica_id)
        pg = dist.ProcessGroupGloo(prefixed(f"live/{where}/", rendezvous), rank,
                                   len(quorum.members), timeout)
        self.group = LiveGroup(pg, rank, quorum.members, f"live-{where}", timeout,
                               self._store)
        self._group_round = quorum.group
        self._watchdog.watch(quorum.round, quorum.members, self.group)

    def _transfer(self, quorum: Quorum) -> None:
        """Send the source's state to the quorum's recovering members (a collective call)."""
        if not quorum.recovering:
            return
        key = f"r/{quorum.round}/state.{self.position}"

        def fetch() -> str:
            try:
                return self._wait_key(key, time.monotonic() + self.step_timeout, quorum.round)
            except DtrainError as exc:  # the source died before it wrote the manifest
                raise ReplicaLost(f"replica {quorum.source} sent no state: {exc}") from exc

        assert self.group is not None
        handover.transfer(self.tracked, self.group, quorum.members.index(quorum.source),
                          lambda text: self._store.set(key, text), fetch,
                          load=self.replica_id in quorum.recovering)
