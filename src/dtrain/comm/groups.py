"""Which Group a `group=` argument means.

None means the world: the calling thread's in-process group inside
`dtrain.testing.run_threads`, else torch's default process group (initializing the world
if needed). A torch process group is wrapped once and the wrapper kept, so its sequence
counter, executor and calibration live as long as the world; `forget_all()` drops them at
`dtrain.shutdown()`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import Group, TorchGroup

_thread = threading.local()
_wrapped: dict[int, TorchGroup] = {}


def set_thread_group(group: Group | None) -> None:
    """Make `group` the world of the calling thread (None restores the process world)."""
    _thread.group = group


def resolve(group: Any) -> Group:
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
    wrapped = _wrapped.get(id(group))
    if wrapped is None or wrapped.pg is not group:
        wrapped = _wrapped[id(group)] = TorchGroup(group)
        world_mod.at_shutdown(forget_all)
    return wrapped


def forget_all() -> None:
    """Drop every wrapped torch group (their process groups are being destroyed)."""
    for wrapped in _wrapped.values():
        wrapped.executor.close()
    _wrapped.clear()
