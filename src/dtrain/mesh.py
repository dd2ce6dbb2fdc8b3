"""The Mesh: the process groups of a job's ranks laid out along the parallel axes.

The grid itself (which rank sits where) is the Layout's arithmetic (dtrain.layout). Every
axis has a process group per line of the grid; `Mesh.group(axis)` returns the one this
rank belongs to. Strategies take their group from here, explicitly.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import timeout_of
from dtrain.errors import ConfigError, DtrainError
from dtrain.layout import AXES, resolve_layout

_MESHES: weakref.WeakSet[Mesh] = weakref.WeakSet()
"""The meshes alive: `dtrain.shutdown()` makes each let go of its process groups."""


def _release_all() -> None:
    for mesh in list(_MESHES):
        mesh._release()
    _MESHES.clear()


class Mesh:
    """Lay the ranks out as (pp, dp, tp) and build one process group per axis.

    Args:
        dp: data-parallel degree; inferred from the world size when None.
        tp: tensor-parallel degree (innermost: consecutive ranks).
        pp: pipeline-parallel degree (outermost).
        world: the world to lay out (default: `dtrain.init()`'s).
        replicas: blocks of consecutive ranks, each laid out alike and training a copy of
            the model of its own, synchronized now and then (dtrain.parallel.diloco): the
            axes' groups stay inside a block; `across` joins the ranks at the same place
            of every block.

    Every rank of the job must construct the same Mesh, in the same order relative to
    other group-creating calls.

    Raises:
        ConfigError: the degrees do not multiply to the world size (per replica).
    """

    def __init__(
        self,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        world: world_mod.World | None = None,
        replicas: int = 1,
    ) -> None:
        self.world = world or world_mod.current()
        size = self.world.world_size
        if replicas < 1 or size % replicas:
            raise ConfigError(f"{replicas} replicas do not divide {size} ranks")
        self.replicas, per = replicas, size // replicas
        self.replica, position = divmod(self.world.rank, per)
        self._offset = self.replica * per
        self.layout = resolve_layout(per, dp, tp, pp)
        self.coords = self.layout.coords(position)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._by_members: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for axis in AXES:
            self._groups[axis] = self._group_of(self.ranks(axis))
        self.replica_group = self._group_of(list(range(self._offset, self._offset + per)))
        """The ranks of this rank's replica (the whole world without replicas)."""
        self.across = self._group_of([position + r * per for r in range(replicas)]) \
            if replicas > 1 else None
        """This rank and its counterparts in the other replicas (None without replicas)."""
        _MESHES.add(self)
        world_mod.at_shutdown(_release_all)

    def _release(self) -> None:
        """Let go of the process groups (the world shuts down and destroys them): a mesh a
        script still holds must not keep them, and gloo's threads, alive until exit."""
        self._groups.clear()
        self._by_members.clear()
        self.replica_group = self.across = None

    def _group_of(self, members: list[int]) -> dist.ProcessGroup:
        key = tuple(members)
        if key not in self._by_members:
            if len(members) == self.world.world_size:
                self._by_members[key] = dist.group.WORLD
            else:
                # Only the members create (and synchronize on) their own group.
                self._by_members[key] = dist.new_group(
                    members, timeout=timeout_of(dist.group.WORLD),
                    use_local_synchronization=True)
        return self._by_members[key]

    def size(self, axis: str) -> int:
        """Degree along `axis` ("dp", "tp" or "pp")."""
        return self.layout.size(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along `axis`.

        Raises:
            DtrainError: the world this mesh was laid over has shut down.
        """
        axis = self._check(axis)
        if not self._groups:
            raise DtrainError("this mesh's process groups were destroyed by dtrain.shutdown(): "
                              "build a new Mesh after dtrain.init()")
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in axis order."""
        axis = self._check(axis)
        mine = self.world.rank - self._offset
        return next([self._offset + r for r in g] for g in self.layout.groups(axis) if mine in g)

    @staticmethod
    def _check(axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}: use one of {', '.join(AXES)}")
        return axis

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.size(a)}" for a in ("dp", "tp", "pp"))
        if self.replicas > 1:
            shape += f"; replica {self.replica} of {self.replicas}"
        return f"Mesh({shape}; rank {self.world.rank} at {self.coords})"
