"""The Mesh: how the ranks of a job are laid out along the parallel axes.

Ranks form a grid of shape (pp, dp, tp) with tp innermost, as in Megatron-LM: the ranks
of one tensor-parallel group are consecutive (so they share a machine and its fast links),
data-parallel replicas come next, and pipeline stages are outermost:

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

Every axis has a process group per line of the grid; `Mesh.group(axis)` returns the one
this rank belongs to. Strategies take their group from here, explicitly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import timeout_of
from dtrain.errors import ConfigError

AXES = ("pp", "dp", "tp")  # outermost first


@dataclass(frozen=True)
class Layout:
    """The pure arithmetic of a (pp, dp, tp) grid, without process groups."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def _shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along each axis."""
        return {
            "tp": rank % self.tp,
            "dp": (rank // self.tp) % self.dp,
            "pp": rank // (self.tp * self.dp),
        }

    def rank_of(self, coords: dict[str, int]) -> int:
        """Inverse of `coords`."""
        return (coords["pp"] * self.dp + coords["dp"]) * self.tp + coords["tp"]

    def groups(self, axis: str) -> list[list[int]]:
        """All rank lists along `axis`: one list per combination of the other axes."""
        shape = self._shape()
        others = [a for a in AXES if a != axis]
        lists = []
        for fixed in itertools.product(*(range(shape[a]) for a in others)):
            base = dict(zip(others, fixed, strict=True))
            lists.append([self.rank_of({**base, axis: i}) for i in range(shape[axis])])
        return lists


def resolve_layout(world_size: int, dp: int | None, tp: int, pp: int) -> Layout:
    """Check degrees against the world size and fill in `dp` when it is None.

    Raises:
        ConfigError: a degree is below 1 or the product does not equal the world size.
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if dp is None:
        if world_size % (tp * pp):
            raise ConfigError(
                f"tp*pp = {tp}*{pp} = {tp * pp} does not divide the world size {world_size}: "
                f"choose tp and pp whose product divides {world_size}"
            )
        dp = world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ConfigError(
            f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but the world has {world_size} "
            f"ranks: make the product equal {world_size} (or leave dp unset to infer it)"
        )
    return Layout(dp=dp, tp=tp, pp=pp)


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
        return getattr(self.layout, self._check(axis))

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
