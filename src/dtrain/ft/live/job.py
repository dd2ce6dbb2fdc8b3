"""`[fault_tolerance] mode = "live"` in `dtrain train`: the job's ranks form replicas
of `dp x tp x pp` ranks each (one rank by default), kept alive by
dtrain.ft.live.LiveReplicas.

Under dtrain's launcher each rank runs inside a supervisor (dtrain.launch.supervisor) that
restarts it, with the rest of its replica, when one of them dies. The ranks of a replica
see a world of their own (no default process group spans the replicas: a replacement could
never join one), in which the layout's tp, pp and ZeRO groups are; each learns its replica
id and the number of replicas from DTRAIN_LIVE_ID and DTRAIN_LIVE_SLOTS, and meets the
other replicas through the job's store (dtrain.store: node 0's, or etcd), where
LiveReplicas forms each step's quorum and, per position in the replica, its gloo group.

The training loop sees them as a `LiveMembership` (a dtrain.ft.membership.Membership).
"""

from __future__ import annotations

import os
import sys

import torch

from dtrain import env
from dtrain.config import Config
from dtrain.data_parallel.averaging import Averaging
from dtrain.errors import ConfigError
from dtrain.ft.live.averaging import LiveAveraging
from dtrain.ft.live.replicas import Comparison, LiveReplicas
from dtrain.ft.membership import RunOver
from dtrain.store import connect, prefixed
from dtrain.world import World


def open_live(config: Config, world: World) -> LiveMembership | None:
    """This rank's live membership when the job runs live replicas (`world`: its
    replica's); None otherwise.

    Raises:
        ConfigError: live replicas asked for outside dtrain's launcher.
    """
    if config.fault_tolerance.mode != "live":
        return None
    if not env.LIVE_ID.is_set():
        raise ConfigError("fault_tolerance.mode = \"live\" needs dtrain's launcher (dtrain "
                          "train -n N, or dtrain run through dtrain.launch.supervisor): under "
                          "another launcher use fault_tolerance.mode = \"restart\"")
    store = prefixed(f"dtrain/live/{env.RUN_ID.get() or ''}/", connect(60.0))
    step_timeout = config.fault_tolerance.step_timeout
    live_id, slots = env.LIVE_ID.get(), env.LIVE_SLOTS.get()
    assert live_id is not None and slots is not None  # set together by dtrain's launcher
    live = LiveReplicas(store, live_id, slots,
                        step_timeout=step_timeout, heartbeat_timeout=min(2.0, step_timeout),
                        position=world.rank, positions=world.world_size)
    return LiveMembership(live, step_timeout)


class LiveMembership:
    """Live replicas as the training loop sees them (a dtrain.ft.membership.Membership):
    each step's quorum takes part; a joiner starts at its peers' step; the first replica of
    each step's quorum records it and writes checkpoints (replica 0 may be gone)."""

    def __init__(self, live: LiveReplicas, step_timeout: float) -> None:
        self.live, self.step_timeout = live, step_timeout
        self.copies, self.copy = live.slots, live.replica_id
        self.worlds, self.steady = live.slots, False  # each live replica a world of its own
        self.averaging: Averaging | None = LiveAveraging(live)  # as Membership declares it
        self.first = live.replica_id == 0
        self.joined_late = env.LIVE_INCARNATION.get() > 0 or live.replica_id > 0
        self._writer: int | None = None  # the previous step's, if this replica applied it

    def track(self, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.live.track(optimizer=optimizer,
                        save_extra=lambda: {"schedule": scheduler.state_dict()},
                        load_extra=lambda extra: scheduler.load_state_dict(extra["schedule"]))

    def describe(self, ranks: str, world_size: int) -> str:
        each = "data-parallel replica(s)" if world_size == 1 else f"replica(s) of {ranks}"
        return f"{self.live.slots} live {each} (step timeout {self.step_timeout:g}s)"

    def begin_step(self, step: int) -> int:
        self._writer = self._first_holder() if self.live.committed else None
        if self.live.committed:
            _say_ready()
        try:
            return self.live.begin_step(step)
        except RunOver:  # the others finished while this one waited to rejoin
            self.live.close()
            raise

    def applies_step(self) -> bool:
        return self.live.committed

    def writes(self) -> bool:
        """Whether this replica records the step and writes its checkpoint: the first of the
        quorum that committed it among those that held the state before it (a replacement
        sent the state in this step has no record of the step before, which its writer may
        have to write: `took_over`). A replica dropped from the step (no quorum, its state
        stale until it recovers) does not, though it would be the first of an empty one."""
        return self.live.committed and self.live.replica_id == self._first_holder()

    def _first_holder(self) -> int | None:
        """The first replica of the quorum that held the state when it formed (every
        member, when none did: the job's first step)."""
        held = self.live.continuing or self.live.members
        return min(held) if held else None

    def took_over(self) -> bool:
        """Whether this replica writes the step in place of the previous step's writer,
        which is gone from it: killed, perhaps, after that step was applied and before its
        record was written."""
        return (self.writes() and self._writer is not None
                and self._writer != self.live.replica_id
                and self._writer not in self.live.continuing)

    def step_metrics(self) -> dict[str, int]:
        return {"live_replicas": len(self.live.participants)}

    def compare(self) -> dict[str, int]:
        """`same_weights`: how many of the step's live replicas hold the first one's
        parameters at every position (on the rank that compares)."""
        seen = self.live.compare_weights()
        if seen is None:
            return {}
        _warn(seen)
        return {"same_weights": len(seen.same)}

    def finish(self) -> None:
        """Compare the live replicas' final weights (one line), then leave."""
        seen = self.live.compare_weights()
        if seen is not None:
            _warn(seen)
            if not seen.other and len(seen.same) > 1:
                gone = f" ({len(seen.silent)} left before comparing)" if seen.silent else ""
                print(f"dtrain: the {len(seen.same)} live replicas end with the same weights"
                      f"{gone}", flush=True)
        self.live.finish()
        self.live.close()


def _say_ready() -> None:
    """Tell this rank's supervisor, once, that it has taken part in a step (one byte into
    DTRAIN_LIVE_READY_FD): it then starts the rank's warm standby (dtrain.launch.standby)."""
    fd = env.LIVE_READY_FD.get()
    if fd is None:
        return
    env.LIVE_READY_FD.unset()
    try:
        os.write(fd, b"1")
        os.close(fd)
    except OSError:  # the supervisor is gone: nothing to start
        pass


def _warn(seen: Comparison) -> None:
    """One line per live replica whose weights differ from the first one's."""
    for replica, positions in seen.other.items():
        where = ", ".join(map(str, positions))
        print(f"dtrain: warning: step {seen.step}: live replica {replica} holds other weights "
              f"than live replica {seen.first} (at rank {where} of the replica): the state it "
              "holds is not the one the others train; its gradients are averaged in anyway",
              file=sys.stderr, flush=True)
