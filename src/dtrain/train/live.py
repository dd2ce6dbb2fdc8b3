"""`[parallel] fault_tolerance = "live"` in `dtrain train`: the job's ranks form replicas
of `dp x tp x pp` ranks each (one rank by default), kept alive by
dtrain.parallel.live.LiveReplicas.

Under dtrain's launcher each rank runs inside a supervisor (dtrain.launch.replica) that
restarts it, with the rest of its replica, when one of them dies. The ranks of a replica
see a world of their own (no default process group spans the replicas: a replacement could
never join one), in which the layout's tp, pp and ZeRO groups live; each learns its
replica id and the number of replicas from `ID_ENV` and `SLOTS_ENV`, and meets the other
replicas through the job's store (MASTER_ADDR:MASTER_PORT), where LiveReplicas forms each
step's quorum and, per position in the replica, its gloo group.
"""

from __future__ import annotations

import os
from datetime import timedelta

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.live import LiveReplicas
from dtrain.world import World

ID_ENV = "DTRAIN_LIVE_ID"  # this replica's id: its rank among the launcher's ranks
SLOTS_ENV = "DTRAIN_LIVE_SLOTS"  # the replicas of the job, all alive
INCARNATION_ENV = "DTRAIN_LIVE_INCARNATION"  # 0 first, then 1, 2, ... for its replacements
RANKS_ENV = "DTRAIN_LIVE_RANKS"  # ranks per replica: dp x tp x pp of the config (default 1)


def open_live(config: Config, world: World) -> LiveReplicas | None:
    """This rank's LiveReplicas when the job runs live replicas (`world`: its replica's);
    None otherwise.

    Raises:
        ConfigError: live replicas asked for outside dtrain's launcher.
    """
    if config.parallel.fault_tolerance != "live":
        return None
    if ID_ENV not in os.environ:
        raise ConfigError("parallel.fault_tolerance = \"live\" needs dtrain's launcher (dtrain "
                          "train -n N, or dtrain run through dtrain.launch.replica): under "
                          "another launcher use fault_tolerance = \"restart\"")
    import torch.distributed as dist

    prefix = f"dtrain/live/{os.environ.get('DTRAIN_RUN_ID', '')}/"
    store = dist.PrefixStore(prefix, dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=60)))
    step_timeout = config.parallel.step_timeout
    return LiveReplicas(store, int(os.environ[ID_ENV]), int(os.environ[SLOTS_ENV]),
                        step_timeout=step_timeout, heartbeat_timeout=min(2.0, step_timeout),
                        position=world.rank, positions=world.world_size)


def incarnation() -> int:
    """0 for a replica's first process, k for its k-th replacement."""
    return int(os.environ.get(INCARNATION_ENV, "0") or 0)
