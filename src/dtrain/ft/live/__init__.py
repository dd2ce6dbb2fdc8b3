"""Live replicas: data-parallel replicas that drop a dead peer within the step and take a
replacement back without restarting anything (the idea of torchft).

    replicas   LiveReplicas: membership in rounds, quorums, votes, recovery of a joiner,
               and the replicas' weights compared (Comparison)
    averaging  LiveAveraging: DataParallel's and ZeRO's averaging over each step's quorum
    group      a gloo group per membership, whose collectives fail fast on a lost peer
    rounds     the store side of the rounds: waiting for keys, forgetting old ones
    handover   what a live peer sends a joiner: parameters, optimizer state, step, extras;
               a digest of the parameters
    watchdog   aborts a quorum's group as soon as a member fails or falls silent
    job        `[fault_tolerance] mode = "live"` in `dtrain train`
"""

from dtrain.ft.live.averaging import LiveAveraging
from dtrain.ft.live.replicas import Comparison, LiveReplicas, Outcome

__all__ = ["Comparison", "LiveAveraging", "LiveReplicas", "Outcome"]
