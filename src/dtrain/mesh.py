"""The Mesh: a job's ranks laid out on named parallel axes, and the process group of any
axis, or of any combination of axes, asked for by name.

The axes, outermost first (AXES), as torchtitan's `ParallelDims` names them:

    dp_replicate  replicas: each trains a copy of the model of its own on its part of the
                  global batch and synchronizes with the others only every `sync_every`
                  steps (local SGD, DiLoCo: dtrain.parallel.sync.diloco). A replica is a block
                  of consecutive ranks, each laid out alike.
    pp            pipeline stages.
    dp_shard      the data-parallel ranks inside a replica: each reads its own slice of
                  the replica's batch, and they average gradients every step (DataParallel)
                  or share out the model's state as well (ZeRO).
    cp            context parallel: ranks that split each sequence between them, two of
                  its 2 x cp chunks each (dtrain.context_parallel); the model is replicated
                  over them, so gradients average over group("dp", "cp").
    tp            tensor parallel, innermost: its ranks are consecutive, so they share a
                  machine and its fast links, as in Megatron-LM.

Ranks fill the grid in row-major order, the last axis varying fastest:

    rank = (((r * pp + p) * dp_shard + d) * cp + c) * tp + t

for coordinates (r, p, d, c, t). With dp_replicate = cp = 1 this is the (pp, dp, tp) grid
dtrain has always laid out, rank = p * (dp * tp) + d * tp + t, and a replica is the block
of ranks [r * n, (r + 1) * n) for n = pp * dp_shard * cp * tp.

"dp" is the other name of `dp_shard`, the one strategies and `parallel.dp` have always
used: the data-parallel ranks of one replica, those that average gradients every step. It
never spans dp_replicate, whose replicas meet only every `sync_every` steps (a group over
both is `group("dp_replicate", "dp")`). `Mesh(dp=4)` is `Mesh(dp_shard=4)`, and
`group("dp")`, `size("dp")`, `coords["dp"]` are dp_shard's. With cp > 1, the ranks that
hold the same parameters, and so average their gradients, are `group("dp", "cp")`.

Expert parallelism (`ep`) is carved from dp_shard, as torchtitan carves it: dp_shard
factors into (edp, ep), ep innermost, a second Grid over the same ranks in which
dp_shard's place holds those two axes, so no rank moves:

    ep            the ranks that split each MoE layer's experts between them (E / ep
                  each) and exchange tokens by all-to-all: ep consecutive dp ranks.
    edp           expert data parallel: the ranks that hold the same experts and average
                  their gradients (dp_shard / ep of them).

Dense parameters still average over all of dp_shard. With cp, ep spans dp_shard at each cp
coordinate (torchtitan's spans dp_shard x cp): a rank's tokens go to the experts of the
ranks holding its own chunks, and the ranks holding the same experts are group("edp",
"cp").
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterable, Mapping

import torch.distributed as dist

from dtrain import world as world_mod
from dtrain.comm.group import timeout_of
from dtrain.errors import ConfigError, DtrainError

AXES = ("dp_replicate", "pp", "dp_shard", "cp", "tp")
"""The mesh's axes, outermost first."""

SYNONYMS = {"dp": "dp_shard"}
"""Other names an axis may be asked for by (see the module's docstring for "dp")."""

EXPERT_AXES = ("edp", "ep")
"""The two axes dp_shard factors into under expert parallelism, outermost first."""

_MESHES: weakref.WeakSet[Mesh] = weakref.WeakSet()
"""The meshes alive: `dtrain.shutdown()` makes each let go of its process groups."""


def _release_all() -> None:
    for mesh in list(_MESHES):
        mesh._release()
    _MESHES.clear()


class Grid:
    """Ranks laid out on named axes in row-major order, the last axis varying fastest: the
    arithmetic of a Mesh, with no process groups.

    Args:
        shape: the degree of each axis, outermost first.
    """

    def __init__(self, shape: Mapping[str, int]) -> None:
        self.shape = dict(shape)
        self.world_size = math.prod(self.shape.values())

    def size(self, axes: Iterable[str]) -> int:
        """The product of the degrees of `axes`."""
        return math.prod(self.shape[a] for a in axes)

    def coords(self, rank: int) -> dict[str, int]:
        """The index of `rank` along each axis, outermost first."""
        index = {}
        for axis, degree in reversed(self.shape.items()):
            rank, index[axis] = divmod(rank, degree)
        return {axis: index[axis] for axis in self.shape}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at `coords` (inverse of `coords`)."""
        rank = 0
        for axis, degree in self.shape.items():
            rank = rank * degree + coords[axis]
        return rank

    def ranks(self, rank: int, axes: Iterable[str]) -> list[int]:
        """The ranks of `rank`'s group over `axes`: those at its coordinates on every other
        axis, in ascending order (the grid's axis order)."""
        axes, mine = tuple(axes), self.coords(rank)
        return sorted(self.rank_of({**mine, **dict(zip(axes, index, strict=True))})
                      for index in itertools.product(*(range(self.shape[a]) for a in axes)))


def fit(world_size: int, degrees: Mapping[str, int | None]) -> Grid:
    """The Grid of `degrees` (outermost first) over `world_size` ranks; one degree left None
    is what the others leave of the world size.

    Raises:
        ConfigError: a degree is not a positive integer, more than one is None, or the
            degrees do not multiply to the world size.
    """
    for axis, degree in degrees.items():
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)
                                   or degree < 1):
            raise ConfigError(f"mesh degree {axis}={degree!r} must be a positive integer")
    unset = [axis for axis, degree in degrees.items() if degree is None]
    if len(unset) > 1:
        raise ConfigError(f"mesh degrees {', '.join(unset)} are unset: give all but one, "
                          "which is inferred from the world size")
    shown = [a for a, d in degrees.items() if d is not None and d != 1] or \
        [a for a, d in degrees.items() if d is not None]
    product = "*".join(shown) + " = " + "*".join(str(degrees[a]) for a in shown)
    known = math.prod(d for d in degrees.values() if d is not None)
    if len(shown) > 1:
        product += f" = {known}"
    if unset and world_size % known:
        raise ConfigError(
            f"{product} does not divide the world size {world_size}: choose degrees "
            f"whose product divides {world_size} ({unset[0]} is inferred)")
    if not unset and known != world_size:
        raise ConfigError(
            f"{product} but the world has {world_size} ranks: make the product of the "
            f"degrees equal {world_size} (or leave one unset to infer it)")
    return Grid({axis: world_size // known if degree is None else degree
                 for axis, degree in degrees.items()})


class Mesh:
    """Lay the ranks out on the axes (dp_replicate, pp, dp_shard, cp, tp) and hand out the
    process group of this rank over any of them (see the module's docstring).

    Args:
        dp_shard: the data-parallel degree inside a replica (None: what the other degrees
            leave of the world size).
        tp: tensor-parallel degree (innermost: consecutive ranks).
        pp: pipeline-parallel degree.
        cp: context-parallel degree.
        dp_replicate: how many replicas synchronize every `sync_every` steps (outermost:
            each a block of consecutive ranks).
        dp: the familiar name of dp_shard (`Mesh(dp=4)`); give one of the two.
        ep: expert-parallel degree, carved from dp_shard (groups "ep" and "edp").
        world: the world to lay out (default: `dtrain.init()`'s).

    One degree may be None and is inferred (to infer another than dp_shard, give dp_shard
    and leave that one None). The groups of single axes are made here, so every rank of
    the job must construct the same Mesh, in the same order relative to other
    group-creating calls; a combination's group is made the first time it is asked for
    (see `group`).

    Raises:
        ConfigError: a degree is not a positive integer, more than one is left unset, both
            dp and dp_shard are given, or the degrees do not multiply to the world size.
    """

    def __init__(
        self,
        *,
        dp_shard: int | None = None,
        tp: int | None = 1,
        pp: int | None = 1,
        cp: int | None = 1,
        dp_replicate: int | None = 1,
        dp: int | None = None,
        ep: int = 1,
        world: world_mod.World | None = None,
    ) -> None:
        if dp is not None:
            if dp_shard is not None:
                raise ConfigError(f"Mesh(dp={dp}, dp_shard={dp_shard}): dp is dp_shard's "
                                  "other name; give one of the two")
            dp_shard = dp
        self.world = world or world_mod.current()
        self.grid = fit(self.world.world_size, {"dp_replicate": dp_replicate, "pp": pp,
                                                "dp_shard": dp_shard, "cp": cp, "tp": tp})
        shape = self.grid.shape
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 \
                or shape["dp_shard"] % ep:
            raise ConfigError(f"ep={ep!r} must be a positive integer that divides "
                              f"dp_shard={shape['dp_shard']} (experts split over data-parallel "
                              "ranks)")
        self.expert_grid = Grid({"dp_replicate": shape["dp_replicate"], "pp": shape["pp"],
                                 "edp": shape["dp_shard"] // ep, "ep": ep, "cp": shape["cp"],
                                 "tp": shape["tp"]})
        """The same ranks with dp_shard factored into (edp, ep) (see the module's docstring)."""
        self.coords = self.grid.coords(self.world.rank)
        """This rank's index along each axis, along "dp" (dp_shard's), "ep" and "edp"."""
        self.coords["dp"] = self.coords["dp_shard"]
        expert = self.expert_grid.coords(self.world.rank)
        self.coords["ep"], self.coords["edp"] = expert["ep"], expert["edp"]
        self._by_members: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._by_axes: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._released = False
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
                self._by_members[key] = dist.group.WORLD
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
        grid, names = self._grid_of(axes)
        return grid.size(names)

    def ranks(self, *axes: str) -> list[int]:
        """The global ranks of this rank's group over `axes`, ascending (the mesh's axis
        order, whatever order the axes are named in); no axes: the world.

        Raises:
            ConfigError: an axis name is unknown.
        """
        grid, names = self._grid_of(axes)
        return grid.ranks(self.world.rank, names)

    def group(self, *axes: str) -> dist.ProcessGroup:
        """The process group of this rank over one axis or a combination of axes, by name:
        `group("tp")`, `group("dp", "cp")`, `group("dp_replicate")` (this rank and its
        counterparts in the other replicas), `group("pp", "dp", "cp", "tp")` (this rank's
        replica), `group("ep")` (the ranks that split the experts), `group("edp")` (those
        that hold the same experts); no axes: the world. Each group is made once and kept.

        The first request for a combination of axes makes its group: a collective call, in
        which every rank of the job asks for the same axes, in the same order relative to
        other group-creating calls (the name torch gives a group counts the groups its
        members already hold).

        Raises:
            ConfigError: an axis name is unknown.
            DtrainError: the world this mesh was laid over has shut down.
        """
        grid, key = self._grid_of(axes)
        if self._released:
            raise DtrainError("this mesh's process groups were destroyed by dtrain.shutdown(): "
                              "build a new Mesh after dtrain.init()")
        if key not in self._by_axes:
            self._by_axes[key] = self._group_of(grid.ranks(self.world.rank, key))
        return self._by_axes[key]

    def _grid_of(self, names: tuple[str, ...]) -> tuple[Grid, tuple[str, ...]]:
        """The grid that has `names` (the expert grid when an expert axis is among them,
        dp_shard then standing for its two factors) and the axes in its order."""
        if not any(n in EXPERT_AXES for n in names):
            return self.grid, self._axes(names)
        plain = tuple(n for n in names if n not in EXPERT_AXES)
        chosen = set(self._axes(plain)) if plain else set()
        if "dp_shard" in chosen:
            chosen |= set(EXPERT_AXES)
        chosen |= {n for n in names if n in EXPERT_AXES}
        return self.expert_grid, tuple(a for a in self.expert_grid.shape if a in chosen)

    @staticmethod
    def _axes(names: tuple[str, ...]) -> tuple[str, ...]:
        """`names` as mesh axes in mesh order, synonyms resolved (none: every axis)."""
        unknown = [n for n in names if n not in AXES and n not in SYNONYMS]
        if unknown:
            raise ConfigError(f"unknown mesh axis {unknown[0]!r}: use one of "
                              f"{', '.join(AXES + EXPERT_AXES)} (or dp for dp_shard)")
        named = {SYNONYMS.get(n, n) for n in names}
        return tuple(a for a in AXES if a in named or not names)

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={n}" for a, n in self.grid.shape.items() if n > 1) or "1 rank"
        if self.expert_grid.shape["ep"] > 1:
            shape += f", ep={self.expert_grid.shape['ep']}"
        return f"Mesh({shape}; rank {self.world.rank} at {self.grid.coords(self.world.rank)})"
