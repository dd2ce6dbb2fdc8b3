"""Hierarchical allreduce for ranks on several hosts: shared memory inside, torch across.

    1. reduce-scatter inside each host over shared memory: local rank i holds shard i of
       its host's sum;
    2. allreduce of shard i across the hosts, among the ranks with local rank i (gloo or
       NCCL): each shard crosses the network once per host, not once per rank;
    3. all-gather inside each host over shared memory.

With L ranks on each of H hosts and m bytes: the network carries 2 (H-1)/H * m/L per rank
instead of the flat ring's 2 (N-1)/N * m, and the local steps run at memory speed. Every
shard is reduced in one order by one rank (steps 1 and 2 as bitwise-identical
collectives), so every rank ends with the same bits. The other collectives run flat over
the whole group's torch process group.

Hosts are told apart by host name and node rank (so two `dtrain run --nnodes 2` launches
on one machine count as two hosts); every host must run the same number of the group's
ranks, else the group stays flat.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from dtrain import env
from dtrain.comm.group import Done, Handle, OverTorch, TorchGroup
from dtrain.comm.ops import ReduceOp, shard_sizes
from dtrain.comm.shm import ShmGroup


def host_id() -> str:
    """This process's host: its name and the launcher's node rank (simulated hosts differ)."""
    node = os.environ.get("GROUP_RANK") or env.NODE_RANK.raw() or "0"
    return f"{socket.gethostname()}/{node}"


def hosts_of(below: TorchGroup) -> list[list[int]]:
    """The group ranks of `below`, by host, hosts in order of their lowest rank."""
    store = below.kv()
    generation = (store.add(f"hosts/{below.name}/joined", 1) - 1) // below.size
    prefix = f"hosts/{below.name}/{generation}/"
    store.set(f"{prefix}{below.rank}", host_id())
    names = [store.get(f"{prefix}{r}").decode() for r in range(below.size)]
    by_host: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        by_host.setdefault(name, []).append(r)
    return list(by_host.values())


class HierarchicalGroup(OverTorch):
    """A group spanning hosts: all_reduce in three steps, everything else flat.

    Args:
        below: the group's torch process group (gloo or NCCL).
        hosts: its group ranks by host, as `hosts_of` returns (equal counts per host).
    """

    backend = "shm+torch"
    native_blocks = True

    def __init__(self, below: TorchGroup, hosts: list[list[int]]) -> None:
        super().__init__(below, f"hier-{below.name}")
        mine = next(h for h in hosts if self.rank in h)
        local = mine.index(self.rank)
        to_global = self.below.global_rank
        # Only members call new_group for each sub-group (local synchronization), every
        # rank in the same order: its host's group, then its "column" across hosts.
        timeout = self.below.timeout
        self.local = ShmGroup(TorchGroup(dist.new_group(
            [to_global(r) for r in mine], timeout=timeout, use_local_synchronization=True)))
        self.across = TorchGroup(dist.new_group(
            [to_global(h[local]) for h in hosts], timeout=timeout, use_local_synchronization=True))

    def close(self) -> None:
        super().close()
        self.local.close()
        self.across.close()

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        if op != "all_reduce":
            return self.below.native(op, *args, **kwargs)
        self.run_now(lambda: self._all_reduce(*args, **kwargs))
        return Done()

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        flat, local = tensor.view(-1), self.local
        width = shard_sizes(flat.numel(), local.size)[0]
        padded = torch.zeros(width * local.size, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        shard = torch.empty(width, dtype=flat.dtype, device=flat.device)
        local.native("reduce_scatter", shard, padded, op)
        self.across.native("all_reduce", shard, op).wait()
        local.native("all_gather", padded, shard)
        flat.copy_(padded[: flat.numel()])
