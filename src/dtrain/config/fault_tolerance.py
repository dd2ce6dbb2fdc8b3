"""The `[fault_tolerance]` section: what the job does when a rank dies or stalls, and where
its store lives; and what live replicas work with.

Fault tolerance (dtrain.ft) sits above the config layer, so its section is defined here.

    [fault_tolerance]  mode = "live", step_timeout = 5.0     # default: restart
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig
from dtrain.schema import positive


@dataclass
class FaultToleranceConfig:
    """What the job does when a rank dies or stalls."""

    mode: Literal["restart", "live"] = "restart"
    """restart (every rank restarts from the newest checkpoint, up to --max-restarts
    times) or live (live replicas of dp x tp x pp ranks each, dp being ZeRO's inside a
    live replica: one that loses a rank or stalls is dropped at the next step and the
    others go on without restarting; with --max-restarts K its ranks are restarted in
    place up to K times and recover their state from a live peer)."""
    step_timeout: float = positive(5.0)
    """With mode = "live": seconds a step waits for a late live replica before it is
    dropped (also each collective's timeout)."""
    standby: bool = True
    """With mode = "live" and --max-restarts: each rank's supervisor keeps a warm standby
    process (Python started, torch and the trainer imported, waiting) from which a
    replacement rank starts, so it asks a live peer for the state seconds sooner; it costs
    one idle process per rank (a few hundred MB of host memory)."""
    rdzv_backend: Literal["c10d", "etcd"] = "c10d"
    """Where the job's store lives: c10d (node 0's launcher, at --master: the job cannot
    lose node 0) or etcd (a cluster at rdzv_endpoints that survives losing any one of its
    members; with mode = "live" the job then survives losing any machine). The command
    line's --rdzv-backend wins."""
    rdzv_endpoints: str = ""
    """With rdzv_backend = "etcd": the cluster's members, HOST:PORT,... (--rdzv-endpoints)."""
    rdzv_id: str = ""
    """With rdzv_backend = "etcd": the job's id, the same on every machine and new for each
    job (--rdzv-id)."""

    @property
    def live(self) -> bool:
        """Whether the job runs live replicas."""
        return self.mode == "live"


def check_live(parallel: ParallelConfig) -> None:
    """What a live replica's replacement can be sent, and what keeps live replicas apart.

    Raises:
        ConfigError: a layout live replicas do not support, in one line.
    """
    p, live = parallel, "fault_tolerance.mode = \"live\""
    if p.exchange != "collective":
        raise ConfigError(f"{live} keeps collective live replicas alive, not parallel.exchange "
                          f"= {p.exchange!r}: use parallel.exchange = \"collective\" or "
                          "fault_tolerance.mode = \"restart\"")
    if p.dp_replicate > 1:
        raise ConfigError(f"{live}: the live replicas are hybrid sharding's replicas already "
                          "(each one shards over its own ranks with ZeRO, and its shards are "
                          "averaged with the other replicas' every step): set "
                          "parallel.dp_replicate = 1")
    if p.dp > 1 and not p.zero:
        raise ConfigError(f"{live}: parallel.dp = {p.dp} is data parallelism inside a live "
                          "replica, which only ZeRO does (the live replicas are the data "
                          "parallelism): set parallel.zero = 1, 2 or 3, or parallel.dp = 0")
    if p.pp > 1 and p.virtual_stages > 1:
        raise ConfigError(f"{live} reduces one pipeline piece per rank: use "
                          "parallel.virtual_stages = 1, or fault_tolerance.mode = \"restart\"")
    if p.cp > 1:
        raise ConfigError(f"parallel.cp = {p.cp} with {live} is not supported yet: use "
                          "fault_tolerance.mode = \"restart\"")
