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

import torch

from dtrain import env
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.ft.live.averaging import LiveAveraging
from dtrain.ft.live.replicas import LiveReplicas
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
    live = LiveReplicas(store, env.LIVE_ID.get(), env.LIVE_SLOTS.get(),
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
        self.averaging = LiveAveraging(live)
        self.first = live.replica_id == 0
        self.joined_late = env.LIVE_INCARNATION.get() > 0 or live.replica_id > 0

    def track(self, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.live.track(optimizer=optimizer,
                        save_extra=lambda: {"schedule": scheduler.state_dict()},
                        load_extra=lambda extra: scheduler.load_state_dict(extra["schedule"]))

    def describe(self, ranks: str, world_size: int) -> str:
        each = "data-parallel replica(s)" if world_size == 1 else f"replica(s) of {ranks}"
        return f"{self.live.slots} live {each} (step timeout {self.step_timeout:g}s)"

    def begin_step(self, step: int) -> int:
        try:
            return self.live.begin_step(step)
        except RunOver:  # the others finished while this one waited to rejoin
            self.live.close()
            raise

    def applies_step(self) -> bool:
        return self.live.committed

    def writes(self) -> bool:
        """Whether this replica records the step and writes its checkpoint: the first of the
        quorum that committed it. A replica dropped from the step (no quorum, its state
        stale until it recovers) does not, though it would be the first of an empty one."""
        members = self.live.members
        return self.live.committed and bool(members) and self.live.replica_id == min(members)

    def step_metrics(self) -> dict[str, int]:
        return {"live_replicas": len(self.live.participants)}

    def finish(self) -> None:
        self.live.finish()
        self.live.close()
