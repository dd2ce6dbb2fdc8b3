"""Which Group a `group=` argument means.

None means the world: the calling thread's in-process group inside
`dtrain.testing.run_threads`, else torch's default process group (initializing the world
if needed). A torch process group is wrapped once and the wrapper kept, so its sequence
counter, executor and calibration live as long as the world; `forget_all()` drops them at
`dtrain.shutdown()`. In a world started with backend "shm" the wrapper moves the data
through shared memory (dtrain.comm.shm, dtrain.comm.algorithms.hierarchical).

A second lane: a thread inside `second_lane()` runs its collectives on each group's twin
(a process group of the same ranks, `add_twin`), so that two threads of one rank, each on
its own lane, never interleave their calls on one communicator (a DualPipeV pair's
forward and backward, dtrain.pipeline.runtime). A group without a twin is refused there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeAlias

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import Group, OverTorch, TorchGroup
from dtrain.errors import DtrainError

GroupLike: TypeAlias = Group | dist.ProcessGroup | None
"""What a `group=` argument may be: a dtrain Group, a torch process group, or None (the
world); `resolve` turns each into a Group."""

_thread = threading.local()
_wrapped: dict[tuple[int, str], TorchGroup | OverTorch] = {}
_twins: dict[int, dist.ProcessGroup] = {}  # id of a process group -> its twin's


def set_thread_group(group: Group | None) -> None:
    """Make `group` the world of the calling thread (None restores the process world)."""
    _thread.group = group


def resolve(group: GroupLike) -> Group:
    """The dtrain Group for a `group=` argument (on the second lane: its twin's).

    Raises:
        TypeError: `group` is neither None, a dtrain Group nor a torch process group.
        DtrainError: on the second lane, a group without a twin.
    """
    if getattr(_thread, "lane", 0):
        return _twin_of(group)
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


def add_twin(pg: dist.ProcessGroup, twin: dist.ProcessGroup) -> None:
    """Make `twin` (the same ranks as `pg`) what the second lane uses for `pg`."""
    _twins[id(pg)] = twin
    world_mod.at_shutdown(_twins.clear)


@contextlib.contextmanager
def second_lane() -> Iterator[None]:
    """Run the calling thread's collectives on the groups' twins inside the block."""
    _thread.lane = 1
    try:
        yield
    finally:
        _thread.lane = 0


def _twin_of(group: GroupLike) -> Group:
    pg: dist.ProcessGroup | None = None
    if isinstance(group, TorchGroup):
        pg = group.pg
    elif isinstance(group, OverTorch):
        pg = group.below.pg
    elif isinstance(group, dist.ProcessGroup):
        pg = group
    elif group is None:
        pg = dist.group.WORLD
    twin = _twins.get(id(pg)) if pg is not None else None
    if twin is None:
        raise DtrainError(f"a collective on {group!r} inside an overlapped backward: the "
                          "group has no twin for the second lane (dtrain.Mesh.second_lane)")
    return wrap(twin, world_mod.current().backend)


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


def wrapped_groups() -> list[Group]:
    """Every process group wrapped so far in this world (`wrap`)."""
    return list(_wrapped.values())


def forget_all() -> None:
    """Drop every wrapped group (their process groups are being destroyed)."""
    for wrapped in _wrapped.values():
        wrapped.close()
    _wrapped.clear()
