"""Averaging a step's tensors over the live quorum (dtrain.parallel.live), for ZeRO.

ZeRO inside a replica reduce-scatters the replica's gradients first; each rank then holds
its shard's gradient, and the same shard of every replica is averaged across replicas on
that position's live group. A failed reduction is redone over the survivors from the
shards each rank kept, as DataParallel does with its buckets (which it reduces while
backward runs; here the shards come at its end).
"""

from __future__ import annotations

import torch

from dtrain import comm
from dtrain.errors import DtrainError
from dtrain.parallel.live import LiveReplicas, Outcome
from dtrain.parallel.live_group import ReplicaLost


@torch.no_grad()
def average(live: LiveReplicas, tensors: list[torch.Tensor]) -> bool:
    """Average `tensors` (this replica's) in place over the replicas of this step's quorum,
    agreeing with them that the step counts; returns whether it does (False: this replica
    was dropped, its tensors left as they were, and it recovers at the next begin_step).

    Raises:
        DtrainError: called outside a step (before `live.begin_step`).
    """
    if live.group is None:
        raise DtrainError("ZeRO(live=...): call live.begin_step(step) before each step's "
                          "backward")
    outcome = Outcome.REDO
    while outcome is Outcome.REDO:
        sent = [t.clone() for t in tensors]
        try:
            for t in sent:
                comm.all_reduce(t, group=live.group, algorithm="native")
            ok = True
        except (ReplicaLost, RuntimeError):
            ok = False
        outcome = live.settle(ok)
    if outcome is Outcome.COMMIT:
        for t, total in zip(tensors, sent, strict=True):
            t.copy_(total.div_(live.size))
    return outcome is Outcome.COMMIT
