"""The Mesh: a job's ranks laid out on named axes by its Dims (dtrain.mesh.dims), and the
process group of any axis, or of any combination of axes, asked for by name.

    mesh = dtrain.Mesh(dp=4, tp=2)            # or Mesh(dims) from a job's Dims
    mesh.group("tp"), mesh.group("dp_cp"), mesh.group("pp", "dp", "cp", "tp")
    mesh.size("dp"), mesh.coords["tp"], mesh.place("dp_cp")

The axes and what each means, the order ranks fill them in, the flattened groups ("dp",
"dp_cp", "edp_cp") and the expert axes ("ep", "edp") are the Dims' (see dtrain.mesh.dims).
The Mesh adds the process groups: those of single axes are made when it is built, every
other the first time it is asked for.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import timeout_of
from dtrain.comm.registry import add_twin
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh.dims import AXES, Dims

_MESHES: weakref.WeakSet[Mesh] = weakref.WeakSet()
"""The meshes alive: `dtrain.shutdown()` makes each let go of its process groups."""


def _release_all() -> None:
    for mesh in list(_MESHES):
        mesh._release()
    _MESHES.clear()


class Mesh:
    """Lay the ranks out on the axes of `dims` (sync, pp, dp_replicate, dp_shard, cp, tp;
    ep and edp over dp_shard) and hand out the process group of this rank over any of them
    (see dtrain.mesh.dims).

    Args:
        dims: the job's Dims; or, instead, its degrees as keywords:
        dp_shard: the sharded data-parallel degree (None: what the other degrees leave of
            the world size).
        tp, pp, cp, dp_replicate, sync, ep: the other degrees (see dtrain.mesh.dims.Dims).
        dp: `Mesh(dp=4)` is `Mesh(dp_shard=4)` (dp_replicate = 1); give one of the two.
        world: the world to lay out (default: `dtrain.init()`'s).

    One degree may be None and is inferred (to infer another than dp_shard, give dp_shard
    and leave that one None). The groups of single axes are made here, so every rank of
    the job must construct the same Mesh, in the same order relative to other
    group-creating calls; a combination's group is made the first time it is asked for
    (see `group`).

    Raises:
        ConfigError: a degree is not a positive integer, more than one is left unset, both
            dp and dp_shard are given, the degrees do not multiply to the world size (the
            Dims' one-line errors).
    """

    def __init__(
        self,
        dims: Dims | None = None,
        *,
        dp_shard: int | None = None,
        tp: int | None = 1,
        pp: int | None = 1,
        cp: int | None = 1,
        dp_replicate: int | None = 1,
        sync: int | None = 1,
        dp: int | None = None,
        ep: int = 1,
        world: world_mod.World | None = None,
    ) -> None:
        self.world = world or world_mod.current()
        if dims is None:
            if dp is not None:
                if dp_shard is not None:
                    raise ConfigError(f"Mesh(dp={dp}, dp_shard={dp_shard}): dp is dp_shard's "
                                      "other name; give one of the two")
                dp_shard = dp
            dims = Dims.fit(self.world.world_size, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp,
                            dp_replicate=dp_replicate, sync=sync, ep=ep)
        elif dims.world_size != self.world.world_size:
            raise ConfigError(f"{dims} has {dims.world_size} ranks but the world has "
                              f"{self.world.world_size}: lay out the world's ranks")
        self.dims = dims
        """The degrees (and how each axis is used) this mesh lays out."""
        self.coords = dims.coords(self.world.rank)
        """This rank's index along each axis, the expert and flattened ones included."""
        self._by_members: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._by_axes: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._released = False
        self._twinned = False
        for axis in AXES:
            self.group(axis)
        _MESHES.add(self)
        world_mod.at_shutdown(_release_all)

    def _release(self) -> None:
        """Let go of the process groups (the world shuts down and destroys them): a mesh a
        script still holds must not keep them, and gloo's threads, alive until exit."""
        self._by_members.clear()
        self._by_axes.clear()
        self._released = True

    def _group_of(self, members: list[int]) -> dist.ProcessGroup:
        key = tuple(members)
        if key not in self._by_members:
            if len(members) == self.world.world_size:
                world = dist.group.WORLD
                assert world is not None  # the world this mesh was built on is started
                self._by_members[key] = world
            else:
                # Only the members create (and synchronize on) their own group.
                self._by_members[key] = dist.new_group(
                    members, timeout=timeout_of(dist.group.WORLD),
                    use_local_synchronization=True)
        return self._by_members[key]

    def size(self, *axes: str) -> int:
        """The number of ranks in a group over `axes`: the product of their degrees (no
        axes: every axis, the world size).

        Raises:
            ConfigError: an axis name is unknown.
        """
        return self.dims.size(*axes)

    def ranks(self, *axes: str) -> list[int]:
        """The global ranks of this rank's group over `axes`, ascending (the mesh's axis
        order, whatever order the axes are named in); no axes: the world.

        Raises:
            ConfigError: an axis name is unknown.
        """
        return self.dims.ranks(self.world.rank, *axes)

    def place(self, *axes: str) -> tuple[int, int]:
        """(index, count): this rank's place among the ranks of its group over `axes` (the
        share of a replicated tensor it writes, the slice of a batch it reads).

        Raises:
            ConfigError: an axis name is unknown.
        """
        ranks = self.ranks(*axes)
        return ranks.index(self.world.rank), len(ranks)

    def group(self, *axes: str) -> dist.ProcessGroup:
        """The process group of this rank over one axis or a combination of axes, by name:
        `group("tp")`, `group("dp_cp")` (the ranks holding the same parameters),
        `group("sync")` (this rank and its counterparts in the other sync groups),
        `group("pp", "dp", "cp", "tp")` (this rank's sync group), `group("ep")` (the ranks
        that split the experts), `group("edp_cp")` (those that hold the same experts); no
        axes: the world. Each group is made once and kept.

        The first request for a combination of axes makes its group: a collective call, in
        which every rank of the job asks for the same axes, in the same order relative to
        other group-creating calls (the name torch gives a group counts the groups its
        members already hold).

        Raises:
            ConfigError: an axis name is unknown.
            DtrainError: the world this mesh was laid over has shut down.
        """
        grid, key = self.dims.axes_of(axes)
        if self._released:
            raise DtrainError("this mesh's process groups were destroyed by dtrain.shutdown(): "
                              "build a new Mesh after dtrain.init()")
        if key not in self._by_axes:
            self._by_axes[key] = self._group_of(grid.ranks(self.world.rank, key))
        return self._by_axes[key]

    def second_lane(self) -> None:
        """Give every group made so far, and the world, a twin of the same ranks for
        collectives a second thread runs at once (dtrain.comm.second_lane: a DualPipeV
        pair's backward beside its forward). A collective call, as `group` is; once."""
        if self._twinned:
            return
        self._twinned = True
        world = dist.group.WORLD
        assert world is not None  # the world this mesh was laid over is started
        add_twin(world, dist.new_group(timeout=timeout_of(world)))
        for members, pg in list(self._by_members.items()):
            if pg is not world:
                add_twin(pg, dist.new_group(list(members), timeout=timeout_of(world),
                                                 use_local_synchronization=True))

    def __repr__(self) -> str:
        where = self.dims.grid.coords(self.world.rank)
        return f"Mesh({self.dims}; rank {self.world.rank} at {where})"
