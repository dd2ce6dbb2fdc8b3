"""The in-process backend: ranks are threads of one process, messages go through queues.

Everything built on dtrain.comm — the algorithms, DataParallel — runs on it unchanged, so
a test of distributed logic takes milliseconds and needs no ports or processes. Use it
through `dtrain.testing.run_threads`. Tensors are copied on send, as a real transport would.

A tensor whose memory was released (its storage resized to nothing, as ZeRO-3 releases a
unit's parameters between its forward and backward and after the step) keeps its shape,
and a copy of it would read through a dangling pointer: the whole process, every thread
rank with it, dies of a segmentation fault. Every tensor a collective or a message reads or
writes is checked first (dtrain.comm.ops `check_held`, which every dtrain.comm collective
applies on every backend), and such a tensor is refused by name instead.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import torch

from dtrain.comm.group import CollectiveTimeout, Done, Group
from dtrain.comm.ops import ReduceOp, check_held, combine_, shards


class Fabric:
    """What the threads of one in-process world share: mailboxes, meeting points, a store."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self._lock = threading.Condition()
        self._mailboxes: dict[tuple[str, int, int, int], queue.Queue[torch.Tensor]] = {}
        self._meetings: dict[tuple[str, int], dict[int, Any]] = {}
        self._readers: dict[tuple[str, int], int] = {}
        self.store: dict[str, str] = {}

    def mailbox(self, name: str, src: int, dst: int, tag: int = 0) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._mailboxes.setdefault((name, src, dst, tag), queue.Queue())

    def meet(self, name: str, seq: int, rank: int, size: int, value: object, what: str
             ) -> list[Any]:
        """Deposit `value`; return everybody's once all `size` members have deposited."""
        key = (name, seq)
        with self._lock:
            values = self._meetings.setdefault(key, {})
            values[rank] = value
            self._lock.notify_all()
            if not self._lock.wait_for(lambda: len(values) == size, timeout=self.timeout):
                missing = sorted(set(range(size)) - set(values))
                raise CollectiveTimeout(
                    f"{what} #{seq} on group {name!r} timed out after {self.timeout:.0f}s: "
                    f"rank(s) {missing} never arrived"
                )
            result = [values[r] for r in range(size)]
            self._readers[key] = self._readers.get(key, 0) + 1
            if self._readers[key] == size:
                del self._meetings[key], self._readers[key]
            return result


class _Recv:
    def __init__(self, box: queue.Queue[torch.Tensor], tensor: torch.Tensor, timeout: float,
                 what: str) -> None:
        self.box, self.tensor, self.timeout, self.what = box, tensor, timeout, what

    def wait(self) -> None:
        try:
            self.tensor.copy_(self.box.get(timeout=self.timeout))
        except queue.Empty:
            raise CollectiveTimeout(f"{self.what} timed out after {self.timeout:.0f}s") from None


class ThreadGroup(Group):
    """One thread's membership of an in-process group.

    Args:
        fabric: shared by all threads of the in-process world.
        rank: this thread's index in the group.
        members: the world ranks of the group's members, in group order.
        name: identical for all members.
    """

    backend = "threads"

    def __init__(self, fabric: Fabric, rank: int, members: list[int], name: str = "world"):
        self.fabric, self.rank, self.members = fabric, rank, members
        self.size = len(members)
        self.name = name
        self.timeout = timedelta(seconds=fabric.timeout)
        super().__init__(f"{name}-{rank}")
        self._native_seq = 0

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Done:
        check_held(tensor, f"send to rank {peer} on group {self.name!r}")
        self.fabric.mailbox(self.name, self.rank, peer, tag).put(tensor.detach().clone())
        return Done()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> _Recv:
        box = self.fabric.mailbox(self.name, peer, self.rank, tag)
        what = f"recv from rank {peer} on group {self.name!r}"
        check_held(tensor, what)
        return _Recv(box, tensor, self.fabric.timeout, what)

    def store_set(self, key: str, value: str) -> None:
        self.fabric.store[key] = value

    def store_get(self, key: str) -> str | None:
        return self.fabric.store.get(key)

    def _gather_all(self, value: object, what: str) -> list[Any]:
        self._native_seq += 1
        return self.fabric.meet(self.name, self._native_seq, self.rank, self.size, value, what)

    def native(self, op: str, *args: Any, **kwargs: Any) -> Done:
        for arg in [*args, *kwargs.values()]:  # the tensors, and a scatter's or gather's lists
            for tensor in arg if isinstance(arg, list) else [arg]:
                if isinstance(tensor, torch.Tensor):
                    check_held(tensor, f"{op} on group {self.name!r} (rank {self.rank})")
        getattr(self, f"_native_{op}")(*args, **kwargs)
        return Done()

    def _reduced(self, tensor: torch.Tensor, op: ReduceOp, what: str) -> torch.Tensor:
        values = self._gather_all(tensor.detach().clone(), what)
        total = values[0].clone()
        for other in values[1:]:  # the same order on every rank: identical results
            combine_(total, other, op)
        return total  # AVG stays a sum, as with torch backends; the caller divides

    def _native_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        tensor.copy_(self._reduced(tensor, op, "all_reduce"))

    def _native_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        total = self._reduced(tensor, op, "reduce")
        if self.rank == root:
            tensor.copy_(total)

    def _native_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp):
        total = self._reduced(tensor, op, "reduce_scatter").reshape(-1)
        out.copy_(shards(total, self.size)[self.rank].view_as(out))

    def _native_all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        values = self._gather_all(tensor.detach().clone(), "all_gather")
        out.copy_(torch.cat([v.reshape(-1) for v in values]).view_as(out))

    def _native_broadcast(self, tensor: torch.Tensor, root: int) -> None:
        values = self._gather_all(tensor.detach().clone() if self.rank == root else None,
                                  "broadcast")
        tensor.copy_(values[root])

    def _native_scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int):
        values = self._gather_all([c.clone() for c in chunks] if chunks else None, "scatter")
        out.copy_(values[root][self.rank])

    def _native_gather(self, tensor: torch.Tensor, chunks: list[torch.Tensor] | None, root: int):
        values = self._gather_all(tensor.detach().clone(), "gather")
        if self.rank == root:
            assert chunks is not None  # the root passes the tensors the pieces land in
            for chunk, value in zip(chunks, values, strict=True):
                chunk.copy_(value)

    def _native_all_to_all(self, out: torch.Tensor, tensor: torch.Tensor,
                           send: list[int], recv: list[int]) -> None:
        values = self._gather_all((tensor.detach().clone(), send), "all_to_all")
        pieces = [v.reshape(-1).split(sizes)[self.rank] for v, sizes in values]
        out.copy_(torch.cat(pieces).view_as(out))

    def _native_barrier(self) -> None:
        self._gather_all(None, "barrier")
