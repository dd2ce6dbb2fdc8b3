"""`[parallel] fault_tolerance = "live"` in `dtrain train`: each rank is a data-parallel
replica of its own (dtrain.parallel.live.LiveReplicas).

Under dtrain's launcher each rank runs inside a supervisor (dtrain.launch.replica) that
restarts it in place when it dies. The rank itself sees a world of one process (no default
process group spans the replicas: a replacement could never join one); it learns its
replica id and the number of replicas from `ID_ENV` and `SLOTS_ENV`, and meets the others
through the job's store (MASTER_ADDR:MASTER_PORT), where LiveReplicas forms each step's
quorum and its gloo group.
"""

from __future__ import annotations

import os
from datetime import timedelta

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.live import LiveReplicas

ID_ENV = "DTRAIN_LIVE_ID"  # this replica's id: its rank among the launcher's ranks
SLOTS_ENV = "DTRAIN_LIVE_SLOTS"  # the replicas of the job, all alive
INCARNATION_ENV = "DTRAIN_LIVE_INCARNATION"  # 0 first, then 1, 2, ... for its replacements


def open_live(config: Config) -> LiveReplicas | None:
    """This rank's LiveReplicas when the job runs live replicas; None otherwise.

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
                        step_timeout=step_timeout,
                        heartbeat_timeout=min(2.0, step_timeout))


def incarnation() -> int:
    """0 for a replica's first process, k for its k-th replacement."""
    return int(os.environ.get(INCARNATION_ENV, "0") or 0)
