"""Which Group a `group=` argument means.

None means the world: the calling thread's in-process group inside
`dtrain.testing.run_threads`, else torch's default process group (initializing the world
if needed). A torch process group is wrapped once and the wrapper kept, so its sequence
counter, executor and calibration live as long as the world; `forget_all()` drops them at
`dtrain.shutdown()`. In a world started with backend "shm" the wrapper moves the data
through shared memory (dtrain.comm.shm, dtrain.comm.algorithms.hierarchical).
"""

from __future__ import annotations

import threading
from typing import TypeAlias

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import Group, OverTorch, TorchGroup

GroupLike: TypeAlias = Group | dist.ProcessGroup | None
"""What a `group=` argument may be: a dtrain Group, a torch process group, or None (the
world); `resolve` turns each into a Group."""

_thread = threading.local()
_wrapped: dict[tuple[int, str], TorchGroup | OverTorch] = {}


def set_thread_group(group: Group | None) -> None:
    """Make `group` the world of the calling thread (None restores the process world)."""
    _thread.group = group


def resolve(group: GroupLike) -> Group:
    """The dtrain Group for a `group=` argument.

    Raises:
        TypeError: `group` is neither None, a dtrain Group nor a torch process group.
    """
    if isinstance(group, Group):
        return group
    if group is None:
        own = getattr(_thread, "group", None)
        if own is not None:
            return own
        world_mod.current()
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch ProcessGroup, a dtrain Group or None, not {group!r}"
        )
    return wrap(group, world_mod.current().backend)


def wrap(pg: dist.ProcessGroup, backend: str) -> Group:
    """The dtrain Group of torch process group `pg`, carried by `backend` (kept per world).

    "shm": shared memory among the ranks of one host, hierarchical across hosts (a
    collective call: every member must make it). Otherwise: `pg` itself.
    """
    key = (id(pg), backend)
    wrapped = _wrapped.get(key)
    if wrapped is None or wrapped.below.pg is not pg:
        wrapped = _wrapped[key] = _new(pg, backend)
        world_mod.at_shutdown(forget_all)
    return wrapped


def _new(pg: dist.ProcessGroup, backend: str) -> TorchGroup | OverTorch:
    below = TorchGroup(pg)
    if backend != "shm" or below.size == 1:
        return below
    from dtrain.comm.algorithms.hierarchical import HierarchicalGroup, hosts_of
    from dtrain.comm.shm import ShmGroup

    hosts = hosts_of(below)
    if len(hosts) == 1:
        return ShmGroup(below)
    if len({len(h) for h in hosts}) > 1:  # uneven hosts: no common shard layout
        return below
    return HierarchicalGroup(below, hosts)


def forget_all() -> None:
    """Drop every wrapped group (their process groups are being destroyed)."""
    for wrapped in _wrapped.values():
        wrapped.close()
    _wrapped.clear()
