"""The group of one live quorum: a standalone gloo process group behind dtrain's Group.

Live replicas (dtrain.ft.live) make a new process group whenever their membership
changes. Such a group is made directly on the store (`ProcessGroupGloo(store, rank,
size, timeout)`), not through `torch.distributed.new_group`: a replacement process never
joined torch's default group, and never can. torch.distributed's module functions do not
know the group, so `LiveGroup` drives it through its own methods, and turns a collective
that fails (a member died, or stalled past the timeout) into `ReplicaLost`.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.group import CollectiveTimeout, Group, Handle
from dtrain.comm.ops import ReduceOp
from dtrain.errors import DtrainError


class ReplicaLost(CollectiveTimeout):
    """A collective on a live quorum failed: a member died, stalled or left."""


class _Work:
    """A collective in flight; its wait gives up as soon as the group is aborted (gloo's own
    abort does not interrupt an operation already running)."""

    def __init__(self, work: dist.Work, group: LiveGroup) -> None:
        self._work, self._group = work, group

    def wait(self) -> None:
        done = threading.Event()
        self._work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(0.02):
            if self._group.aborted.is_set():
                raise ReplicaLost(f"collective on live group {self._group.name} abandoned: "
                                  "a member failed or went silent")
        try:
            self._work.wait()
        except RuntimeError as exc:  # ReplicaLost skips dtrain.comm's diagnosis: no waiting
            raise ReplicaLost(f"collective on live group {self._group.name} failed: "
                              f"{exc}") from exc


class LiveGroup(Group):
    """The dtrain Group of one quorum: a standalone gloo process group (not registered with
    torch.distributed, so it is driven through its own methods)."""

    backend = "gloo"

    def __init__(self, pg: dist.ProcessGroupGloo, rank: int, members: list[int], name: str,
                 timeout: timedelta, store: dist.Store) -> None:
        self.pg, self.rank, self.size, self.name = pg, rank, len(members), name
        self.members, self.timeout, self._store = members, timeout, store
        self.aborted = threading.Event()
        super().__init__(name)

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank]  # the replica id

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return _Work(self.pg.send([tensor], peer, tag), self)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return _Work(self.pg.recv([tensor], peer, tag), self)

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        if op == "all_reduce":
            tensor, reduce = args
            options = dist.AllreduceOptions()
            options.reduceOp = ReduceOp.parse(reduce).to_torch()
            return _Work(self.pg.allreduce([tensor], options), self)
        if op == "broadcast":
            tensor, root = args
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = root, 0
            return _Work(self.pg.broadcast([tensor], options), self)
        if op == "all_gather":
            out, tensor = args
            return _Work(self.pg.allgather([list(out.chunk(self.size))], [tensor]), self)
        if op == "barrier":
            return _Work(self.pg.barrier(), self)
        raise DtrainError(f"a live group offers all_reduce, broadcast, all_gather and "
                          f"barrier natively, not {op}")

    def store_set(self, key: str, value: str) -> None:
        self._store.set(f"kv/{self.name}/{key}", value)

    def store_get(self, key: str) -> str | None:
        key = f"kv/{self.name}/{key}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def abort(self) -> None:
        """Fail every collective queued or waited on on this group, at once. (One already
        running in gloo goes on until the timeout: keep the group referenced until then,
        since dropping it joins gloo's threads.)"""
        self.aborted.set()
        self.pg.abort()

    def close(self) -> None:
        super().close()
        self.abort()
