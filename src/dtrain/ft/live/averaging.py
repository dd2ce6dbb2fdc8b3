"""Averaging over the live quorum: DataParallel's and ZeRO's `averaging=` for live replicas.

Each buffer is summed on a copy over this step's quorum group, so that this replica's own
gradients stay at hand: when a member fails mid-step, the replicas agree to redo the sums
over the survivors (`LiveReplicas.settle`), from the gradients each kept. DataParallel
starts its buckets while backward runs; ZeRO averages each rank's gradient shard, after
its reduce-scatter inside the replica, with the same shard of the other replicas.
"""

from __future__ import annotations

import torch

from dtrain import comm
from dtrain.comm.group import Handle
from dtrain.data_parallel.averaging import Carried
from dtrain.errors import DtrainError
from dtrain.ft.live.group import ReplicaLost
from dtrain.ft.live.replicas import LiveReplicas, Outcome


class LiveAveraging:
    """Sums over the replicas of each step's quorum (a dtrain.data_parallel.averaging.Averaging).

    Args:
        live: this rank's LiveReplicas; call `live.begin_step(step)` before each step's
            backward. The first quorum, not the wrap, makes the replicas identical.
    """

    def __init__(self, live: LiveReplicas) -> None:
        self.live = live

    def attach(self, carried: Carried, optimizer: torch.optim.Optimizer | None) -> None:
        self.live.carry(carried, optimizer=optimizer if optimizer else None)

    def start(self, buffer: torch.Tensor) -> Handle:
        if self.live.group is None:
            raise DtrainError("live replicas: call live.begin_step(step) before each step's "
                              "backward")
        sent = buffer.clone()
        work: Handle
        try:
            work = comm.all_reduce(sent, group=self.live.group, async_op=True,
                                   algorithm="native")
        except RuntimeError as exc:  # the group broke before the call even started
            work = _Failed(exc)
        return _Sum(sent, work)

    @torch.no_grad()
    def finish(self, started: list[Handle], buffers: list[torch.Tensor]) -> int:
        outcome = self.live.settle(_completed(started))
        while outcome is Outcome.REDO:
            started = [self.start(b) for b in buffers]
            outcome = self.live.settle(_completed(started))
        if outcome is not Outcome.COMMIT:
            return 0  # dropped: this replica's state is replaced as it recovers
        for buffer, total in zip(buffers, started, strict=True):
            assert isinstance(total, _Sum), "finish() takes what this averaging's start() gave"
            buffer.copy_(total.sent)
        return self.live.size


class _Sum:
    """A buffer's copy being summed, and the collective summing it."""

    def __init__(self, sent: torch.Tensor, work: Handle) -> None:
        self.sent, self._work = sent, work

    def wait(self) -> None:
        self._work.wait()


class _Failed:
    """The handle of a collective that could not even start."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def wait(self) -> None:
        raise ReplicaLost(f"collective on the live group could not start: {self._error}")


def _completed(started: list[Handle]) -> bool:
    """Whether every sum completed (stops at the first that failed)."""
    try:
        for handle in started:
            handle.wait()
        return True
    except (ReplicaLost, RuntimeError):
        return False
