"""The Mesh: the process groups of a job's ranks laid out along the parallel axes.

The grid itself (which rank sits where) is the Layout's arithmetic (dtrain.layout). Every
axis has a process group per line of the grid; `Mesh.group(axis)` returns the one this
rank belongs to. Strategies take their group from here, explicitly.
"""

from __future__ import annotations

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import timeout_of
from dtrain.layout import AXES, resolve_layout


class Mesh:
    """Lay the ranks out as (pp, dp, tp) and build one process group per axis.

    Args:
        dp: data-parallel degree; inferred from the world size when None.
        tp: tensor-parallel degree (innermost: consecutive ranks).
        pp: pipeline-parallel degree (outermost).
        world: the world to lay out (default: `dtrain.init()`'s).

    Every rank of the job must construct the same Mesh, in the same order relative to
    other group-creating calls.

    Raises:
        ConfigError: the degrees do not multiply to the world size.
    """

    def __init__(
        self,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        world: world_mod.World | None = None,
    ) -> None:
        self.world = world or world_mod.current()
        self.layout = resolve_layout(self.world.world_size, dp, tp, pp)
        self.coords = self.layout.coords(self.world.rank)
        self._groups: dict[str, dist.ProcessGroup] = {}
        by_members: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for axis in AXES:
            mine = next(g for g in self.layout.groups(axis) if self.world.rank in g)
            key = tuple(mine)
            if key not in by_members:
                if len(mine) == self.world.world_size:
                    by_members[key] = dist.group.WORLD
                else:
                    # Only the members create (and synchronize on) their own group.
                    by_members[key] = dist.new_group(mine, timeout=timeout_of(dist.group.WORLD),
                                                     use_local_synchronization=True)
            self._groups[axis] = by_members[key]

    def size(self, axis: str) -> int:
        """Degree along `axis` ("dp", "tp" or "pp")."""
        return self.layout.size(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along `axis`."""
        return self._groups[self._check(axis)]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in axis order."""
        axis = self._check(axis)
        return next(g for g in self.layout.groups(axis) if self.world.rank in g)

    @staticmethod
    def _check(axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}: use one of {', '.join(AXES)}")
        return axis

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.size(a)}" for a in ("dp", "tp", "pp"))
        return f"Mesh({shape}; rank {self.world.rank} at {self.coords})"
