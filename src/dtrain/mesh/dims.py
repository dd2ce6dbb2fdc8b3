"""The degrees of a job, in one object: how its ranks divide between the parallel axes,
validated once, and every group derived from them.

`Dims` is the one owner of the degrees. The launcher checks a config with it before it
starts a process, an elastic round derives the round's from it, the Trainer builds its
Mesh from it, dtrain.layouts lays the model out by it, checkpoints record it, and the
planners answer with one (as torchtitan's `ParallelDims` serves its trainer).

The axes, outermost first (AXES):

    sync          sync groups: blocks of consecutive ranks that train alone and meet only
                  every `sync.every` steps (local SGD, DiLoCo: dtrain.sync.diloco); 1
                  unless `[sync] method` says otherwise.
    pp            pipeline stages.
    dp_replicate  data parallel, replicated: ranks that hold the same model state and
                  average their gradients every step (HSDP's replicate axis, as
                  torchtitan's: across the slow links, outside dp_shard).
    dp_shard      data parallel, sharded: ZeRO shares the model state out over it;
                  DataParallel replicates over it as over dp_replicate.
    cp            context parallel: ranks that split each sequence between them (two of
                  its 2 x cp chunks each); the model is replicated over them.
    tp            tensor parallel, innermost: consecutive ranks, so they share a machine.

Ranks fill the grid in row-major order, the last axis varying fastest:

    rank = ((((s * pp + p) * dp_replicate + r) * dp_shard + d) * cp + c) * tp + t

Groups over several axes have names of their own (FLATTENED):

    dp            dp_replicate x dp_shard: the data-parallel world, each rank reading its
                  own slice of the global batch (within its sync group).
    dp_cp         dp x cp: the ranks that hold the same parameters; gradients and the
                  reported loss average over them.
    edp_cp        under expert parallelism, every rank holding the same experts, over
                  which the experts' gradients average: dp_replicate x edp (edp spans the
                  cp and tp ranks too, as ep is folded over them; the name is the one it
                  had when ep lived in dp alone).

Expert parallelism (`ep`) is folded over the ranks of one replica of one stage, dp_shard x
cp x tp, as Megatron-Core's "parallel folding" lays the MoE layers out over the same ranks
as attention but on a mesh of their own (Liu et al., 2025, arXiv 2504.14960; expert tensor
parallelism 1). Those ranks factor into (edp, ep), ep innermost: a second Grid over the same
ranks in which the three axes' place holds those two (EXPERT_AXES), so no rank moves:

    ep            the ranks that split each MoE layer's experts between them (E / ep each)
                  and exchange tokens by all-to-all: ep consecutive ranks of dp_shard x cp
                  x tp, the innermost axes first (tp's ranks share a machine, then cp's):
                  an exchange over them takes the fastest links there are.
    edp           expert data parallel: the dp_shard x cp x tp / ep ranks of a replica
                  holding the same experts.

With tp > 1 the tp ranks of an ep group see the same tokens (or, under sequence
parallelism, each its own part of them); their MoE layers then each take 1/tp of the
tokens' assignments (dtrain.models.moe), so that every assignment reaches its expert once.
ep need only divide dp_shard x cp x tp; a request for ep or edp with some but not all of
the axes they are folded over has no single grid, and is refused.

Beside the degrees, Dims holds how the axes are used where that changes what a rank holds
or sends: the ZeRO stage over dp_cp, the pipeline's schedule, context parallelism's
attention method, sequence parallelism over tp, and whether gradients go to parameter
servers instead (`exchange = "ps"`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import InitVar, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, get_args

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.mesh.config import ParallelConfig


class Axis(StrEnum):
    """The name of an axis, or of a flattened group of axes (a `str`: `Axis.TP == "tp"`)."""

    SYNC = "sync"
    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EDP = "edp"
    EP = "ep"
    DP = "dp"
    DP_CP = "dp_cp"
    EDP_CP = "edp_cp"


AXES: tuple[Axis, ...] = (Axis.SYNC, Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP,
                          Axis.TP)
"""The mesh's axes, outermost first."""

EXPERT_AXES: tuple[Axis, ...] = (Axis.EDP, Axis.EP)
"""The two axes FOLDED factors into under expert parallelism, outermost first."""

FOLDED: tuple[Axis, ...] = (Axis.DP_SHARD, Axis.CP, Axis.TP)
"""The axes expert parallelism is folded over, outermost first: the innermost block of the
grid (one replica of one stage), which (edp, ep) lay out again."""

FLATTENED: dict[Axis, tuple[Axis, ...]] = {
    Axis.DP: (Axis.DP_REPLICATE, Axis.DP_SHARD),
    Axis.DP_CP: (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP),
    Axis.EDP_CP: (Axis.DP_REPLICATE, Axis.EDP),
}
"""Groups over several axes, by the one name they are asked for by."""

Schedule = Literal["gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev"]
"""A pipeline schedule (dtrain.pipeline.schedules)."""
SCHEDULES: tuple[str, ...] = get_args(Schedule)
V_SHAPED = ("zbv", "dualpipev")
"""The schedules that place a rank's two chunks in a V (dtrain.pipeline.schedules.Placement):
its first and last stages on one rank."""

CpMethod = Literal["ring", "allgather", "alltoall"]
"""How context parallelism's ranks attend over the whole sequence
(dtrain.context_parallel.attention): a ring of key/value blocks, one all-gather of keys
and values, or Ulysses' all-to-all of heads."""
CP_METHODS: tuple[str, ...] = get_args(CpMethod)

Exchange = Literal["collective", "ps"]
"""How gradients meet: collectives among the ranks, or parameter servers (dtrain.ps)."""
EXCHANGES: tuple[str, ...] = get_args(Exchange)

ZERO_STAGES = (0, 1, 2, 3)


def _config_key(name: str) -> str:
    """A field of Dims as the `[parallel]` key that sets it."""
    return "parallel.dp" if name == "dp_shard" else f"parallel.{name}"


class Grid:
    """Ranks laid out on named axes in row-major order, the last axis varying fastest: the
    arithmetic of a mesh, with no process groups.

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


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"mesh degree {name}={value!r} must be a positive integer")


def _fit(world_size: int, degrees: dict[str, int | None], always: tuple[str, ...] = (),
         inferred: str = "one") -> dict[str, int]:
    """`degrees` (by the names the user gave them) with the one left None inferred from
    `world_size`; an error shows the product of those above 1 and of those in `always`, in
    the order of `degrees`, and names `inferred` as the degree that could be left unset.

    Raises:
        ConfigError: a degree is not a positive integer, more than one is unset, or they do
            not multiply to the world size (the product shown with the degrees above 1).
    """
    for name, degree in degrees.items():
        if degree is not None:
            _positive(name, degree)
    unset = [a for a, d in degrees.items() if d is None]
    if len(unset) > 1:
        raise ConfigError(f"mesh degrees {', '.join(unset)} are unset: give all but one, "
                          "which is inferred from the world size")
    shown = [a for a, d in degrees.items() if d is not None and (d != 1 or a in always)] or \
        [a for a, d in degrees.items() if d is not None]
    known = math.prod(d for d in degrees.values() if d is not None)
    product = "*".join(shown) + " = " + "*".join(str(degrees[a]) for a in shown)
    if len(shown) > 1:
        product += f" = {known}"
    if unset and world_size % known:
        raise ConfigError(
            f"{product} does not divide the world size {world_size}: choose degrees whose "
            f"product divides {world_size} ({unset[0]} is inferred)")
    if not unset and known != world_size:
        raise ConfigError(
            f"{product} but the world has {world_size} ranks: make the product equal "
            f"{world_size} (or leave {inferred} unset to infer it)")
    return {a: world_size // known if d is None else d for a, d in degrees.items()}


@dataclass(frozen=True)
class Dims:
    """A job's degrees and how each axis is used; validated when made (see the module's
    docstring).

    Args:
        dp_shard, tp, pp: the degrees of the mesh's axes of those names.
        zero: the ZeRO stage over dp_cp (0: DataParallel).
        microbatches, schedule, virtual_stages: the pipeline's (read where pp > 1).
        exchange: "collective", or "ps": parameter servers hold the model and every rank
            is a worker training a whole copy (no other axis may be split).
        ep: expert-parallel degree, folded over dp_shard x cp x tp (it adds no ranks).
        cp, dp_replicate: the degrees of the mesh's axes of those names.
        sync: how many sync groups train alone between synchronizations.
        cp_method: context parallelism's attention (read where cp > 1).
        sequence_parallel: sequence parallelism between tp's layers (needs tp > 1).

    Raises:
        ConfigError: in one line naming what to change, when a degree is not a positive
            integer, ep does not divide dp_shard x cp x tp, an option does not fit the degrees
            (sequence parallelism without tp, parameter servers with any split), or a
            name is unknown.
    """

    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    exchange: Exchange = "collective"
    ep: int = 1
    cp: int = 1
    dp_replicate: int = 1
    sync: int = 1
    cp_method: CpMethod = "ring"
    sequence_parallel: bool = False
    named: InitVar[Callable[[str], str]] = str
    """How the errors name a field: as is (a Mesh's keywords), or as the config's key."""

    def __post_init__(self, named: Callable[[str], str]) -> None:
        self.check(named)

    def check(self, key: Callable[[str], str] = str) -> None:
        """The rules of the degrees and options (run when made); `key` names a field as
        the user wrote it (`Dims.of` passes `parallel.NAME`).

        Raises:
            ConfigError: the first rule broken, in one line.
        """
        for axis in (*AXES, Axis.EP):
            _positive(key(axis), getattr(self, axis))
        _positive(key("microbatches"), self.microbatches)
        _positive(key("virtual_stages"), self.virtual_stages)
        for name, value, allowed in (("zero", self.zero, ZERO_STAGES),
                                     ("schedule", self.schedule, SCHEDULES),
                                     ("exchange", self.exchange, EXCHANGES),
                                     ("cp_method", self.cp_method, CP_METHODS)):
            if value not in allowed:
                raise ConfigError(f"{key(name)}={value!r}: use one of "
                                  f"{', '.join(map(str, allowed))}")
        folded = self.dp_shard * self.cp * self.tp
        if folded % self.ep:
            names = " x ".join(key(a).rpartition(".")[2] for a in FOLDED)
            ranks = f"{names} = {self.dp_shard} x {self.cp} x {self.tp} = {folded}"
            if self.dp_replicate > 1:
                ranks += f" in each of {key('dp_replicate')} = {self.dp_replicate} replicas"
            raise ConfigError(f"{key('ep')} = {self.ep} does not divide the ranks it is folded "
                              f"over ({ranks}): choose an ep that divides {folded}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(f"{key('sequence_parallel')} needs {key('tp')} > 1 (it splits "
                              "the sequence across the tensor-parallel ranks): set "
                              f"{key('tp')}")
        if self.exchange == "ps":
            defaults = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "dp_replicate": 1}
            split = [f"{key(a)} = {getattr(self, a)}" for a, default in defaults.items()
                     if getattr(self, a) != default]
            if split:
                raise ConfigError(f"{key('exchange')} = \"ps\" trains whole copies of the "
                                  "model on the workers, with parameter servers holding it: "
                                  f"set {', '.join(split)} back to the default")

    @classmethod
    def fit(cls, world_size: int, *, dp_shard: int | None = None, **values: Any) -> Dims:
        """The Dims of `values` on `world_size` ranks, dp_shard inferred when None (what
        the other degrees leave of the world size); `values` are the other fields (one
        other degree may be None instead, inferred with dp_shard given).

        Raises:
            ConfigError: a degree is not a positive integer, more than one is unset, or
                the degrees do not multiply to the world size.
        """
        degrees: dict[str, int | None] = {a.value: values.pop(a, 1) for a in AXES}
        degrees["dp_shard"] = dp_shard
        # _fit's keys are the degrees' fields, every one an int
        return cls(**_fit(world_size, degrees), **values)  # type: ignore[arg-type]

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int, sync_groups: int | None = None
           ) -> Dims:
        """A job's Dims from its `[parallel]` section on `world_size` ranks: `parallel.dp =
        0` takes what tp, cp and pp leave; `sync_groups` is None when gradients meet every
        step, else `[sync] groups` (0: each sync group dp x cp x tp x pp ranks, dp 1 when
        unset). Errors name the config's keys.

        Raises:
            ConfigError: the degrees do not fit `world_size`, or break a rule of `check`.
        """
        p = parallel
        sync = 1
        if sync_groups is not None:
            sync = sync_groups or world_size // p.copy_ranks
            if sync < 1 or world_size % sync:
                raise ConfigError(f"sync.groups = {sync} does not divide {world_size} ranks "
                                  "into sync groups of dp x cp x tp x pp: choose a divisor of "
                                  f"{world_size}")
        # in the product's words as `[parallel]` has always shown it: dp*cp*tp*pp
        degrees = _fit(world_size, {"sync": sync, "dp": p.dp or None, "cp": p.cp, "tp": p.tp,
                                    "pp": p.pp}, always=("tp", "pp"), inferred="dp")
        if degrees["dp"] % p.dp_replicate:
            raise ConfigError(f"parallel.dp_replicate = {p.dp_replicate} does not divide the "
                              f"data-parallel ranks (dp = {degrees['dp']}): choose a divisor "
                              f"of {degrees['dp']} (the replicas of dp / dp_replicate ranks "
                              "each)")
        return cls(dp_shard=degrees["dp"] // p.dp_replicate, dp_replicate=p.dp_replicate,
                   tp=p.tp, pp=p.pp, cp=p.cp, sync=sync, ep=p.ep,
                   zero=p.zero, microbatches=p.microbatches, schedule=p.schedule,
                   virtual_stages=p.virtual_stages, exchange=p.exchange,
                   cp_method=p.cp_method, sequence_parallel=p.sequence_parallel,
                   named=_config_key)

    # ------------------------------------------------------------------ the grid
    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, a) for a in AXES)

    @property
    def edp(self) -> int:
        """Expert data parallel: the dp_shard x cp x tp ranks of a replica that hold the
        same experts."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def dp(self) -> int:
        """The data-parallel degree: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def grid(self) -> Grid:
        return Grid({a.value: getattr(self, a) for a in AXES})

    @property
    def expert_grid(self) -> Grid:
        """The same ranks with dp_shard x cp x tp factored into (edp, ep)."""
        return Grid({a.value: getattr(self, a) for a in (Axis.SYNC, Axis.PP, Axis.DP_REPLICATE,
                                                         Axis.EDP, Axis.EP)})

    def axes_of(self, names: Iterable[str]) -> tuple[Grid, tuple[str, ...]]:
        """The grid that has `names` (the expert grid when an expert axis is among them,
        dp_shard x cp x tp then standing for its two factors) and the axes, flattened
        names expanded, in its order; no names: every axis.

        Raises:
            ConfigError: a name is not an axis, or an expert axis is asked for with some
                but not all of the axes ep is folded over (of degree above 1).
        """
        names = tuple(names)
        unknown = [n for n in names if n not in Axis.__members__.values()]
        if unknown:
            raise ConfigError(f"unknown mesh axis {unknown[0]!r}: use one of "
                              f"{', '.join(a.value for a in Axis)}")
        expanded = {a for n in names for a in FLATTENED.get(Axis(n), (Axis(n),))}
        if not expanded & set(EXPERT_AXES):
            return self.grid, tuple(a.value for a in AXES if a in expanded or not names)
        split = {a for a in FOLDED if getattr(self, a) > 1}  # of degree 1: no ranks to name
        if expanded & split and not split <= expanded:
            raise ConfigError(
                f"mesh axes {', '.join(names)}: ep and edp are laid over "
                f"{' x '.join(a.value for a in FOLDED)} together; ask for them with all of "
                f"{', '.join(a.value for a in FOLDED if a in split)} or none")
        if split and split <= expanded:  # the whole block: both of its factors
            expanded |= set(EXPERT_AXES)
        grid = self.expert_grid
        return grid, tuple(a for a in grid.shape if a in expanded)

    def size(self, *axes: str) -> int:
        """The number of ranks in a group over `axes` (no axes: the world size)."""
        grid, names = self.axes_of(axes)
        return grid.size(names)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index along every axis, expert and flattened ones included (a flattened
        one's index is the rank's place in its group)."""
        coords = self.grid.coords(rank)
        coords.update({a: i for a, i in self.expert_grid.coords(rank).items()
                       if a in EXPERT_AXES})
        for name in FLATTENED:
            coords[name.value] = self.ranks(rank, name).index(rank)
        return coords

    def ranks(self, rank: int, *axes: str) -> list[int]:
        """The ranks of `rank`'s group over `axes`, ascending (no axes: the world)."""
        grid, names = self.axes_of(axes)
        return grid.ranks(rank, names)

    # ------------------------------------------------------------------ the batch
    @property
    def batch_shards(self) -> int:
        """How many slices each global batch is cut into: one per data-parallel rank of
        each sync group (cp, tp and pp ranks share their slice)."""
        return self.sync * self.dp

    def per_rank_batch(self, batch_size: int, grad_accum: int, live_replicas: int = 1) -> int:
        """Sequences each data-parallel rank feeds per forward (a pipeline cuts them
        further into `microbatches`), when the global batch of `batch_size` sequences is
        cut into `batch_shards` slices, each the same in each of `live_replicas` (each a
        world of its own: dtrain.ft.live).

        Raises:
            ConfigError: the global batch does not split evenly into ranks and
                micro-batches.
        """
        micro = grad_accum * (self.microbatches if self.pp > 1 else 1)
        shards = self.batch_shards * live_replicas
        parts = shards * micro
        if batch_size % parts:
            raise ConfigError(
                f"train.batch_size = {batch_size} does not split into {shards} "
                f"data-parallel rank{'s' if shards > 1 else ''} x "
                f"{micro} micro-batches: make it a multiple of {parts}")
        return batch_size // (shards * grad_accum)

    # ------------------------------------------------------------------ words
    def __str__(self) -> str:
        """Short form, as the planner's table shows it: `dp2 x tp2 x pp2 (1f1b, m=4) zero1`
        (`dp2 x cp2 x tp2` with context parallelism; `dp2x4 ... zero3`: HSDP, 2 replicas
        of 4 sharding ranks)."""
        parts = [f"dp{self.dp}"] if self.dp > 1 or (self.tp == self.pp == self.cp == 1) else []
        if self.dp_replicate > 1:  # HSDP: replicas x the ranks sharding inside each
            parts = [f"dp{self.dp_replicate}x{self.dp_shard}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp} ({self.schedule}{v}, m={self.microbatches})")
        text = " x ".join(parts) + (f" ep{self.ep}" if self.ep > 1 else "")
        return f"{text} zero{self.zero}" if self.zero else text

    def describe(self, how: str = "") -> str:
        """The layout in words, outermost axis first, as the banner of `dtrain train` says
        it; `how` names how the data-parallel ranks train (default: data parallel or
        ZeRO)."""
        how = how or (f"ZeRO stage {self.zero}" if self.zero else "data parallel")
        if self.tp > 1:
            how = f"tensor parallel over {self.tp} x {how}"
        if self.cp > 1:
            how = f"context parallel over {self.cp} x {how}"
        if self.pp > 1:
            how = (f"pipeline of {self.pp} stages ({self.schedule}, {self.microbatches} "
                   f"micro-batches) x {how}")
        experts = f" (experts split over {self.ep})" if self.ep > 1 else ""
        if self.dp_replicate > 1:
            return (f"{how} over {self.dp_shard}{experts}, in each of {self.dp_replicate} "
                    "replicas (HSDP)")
        return f"{how} over {self.dp}{experts}"

    # ------------------------------------------------------------------ as plain values
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values, and the world size: what checkpoints record
        (their `layout` entry) and an elastic round sends (`from_dict` reads it back)."""
        return {"world_size": self.world_size, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Dims:
        """The Dims `to_dict` gave; fields it lacks take their defaults. A checkpoint's
        layout written before the degrees had one owner names dp_shard `dp` and the
        exchange `mode`.

        Raises:
            ValueError: `world_size` is not the product of the degrees.
        """
        renamed = {"dp": "dp_shard", "mode": "exchange"}
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {renamed.get(k, k): v for k, v in values.items()}
        dims = cls(**{k: v for k, v in given.items() if k in fields})
        if values.get("world_size", dims.world_size) != dims.world_size:
            raise ValueError(f"layout {dict(values)} says world_size={values['world_size']}, "
                             f"but its degrees multiply to {dims.world_size}")
        return dims

    def replace(self, **changes: Any) -> Dims:
        """These Dims with `changes` (validated anew; remembered, Dims being immutable:
        the planners' searches ask for the same few variants of each layout many times)."""
        return _replaced(self, tuple(sorted(changes.items())))


@functools.lru_cache(maxsize=4096)
def _replaced(dims: Dims, changes: tuple[tuple[str, Any], ...]) -> Dims:
    return dataclasses.replace(dims, **dict(changes))
