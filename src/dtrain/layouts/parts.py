"""A rank's model and optimizer state as logical tensors (dtrain.checkpoint), both ways.

Whatever the layout, a rank holds parameters in one of two ways:

- *whole or tensor-parallel blocks* (DataParallel, a pipeline's DataParallel pieces, a
  parameter-server worker): the parameter is a tensor; a tensor-parallel layer holds block
  `tp_rank` of it. Its data-parallel copies split the writing: dp rank d writes the d-th
  share of the elements (`Tensors`).
- *ZeRO shards*: the rank holds ranges of the flattened (block of the) parameter, and
  writes exactly those (`Shards`).

`Names` maps a parameter to its logical tensor: named as in the plain model (`canonical`;
a pipeline piece's names are already the whole model's, and the head's weight, tied to
the embedding, is `wte.weight`), cut by its tensor-parallel `Split` if any, and written
once: replicated tensors by tp rank 0, a tied copy by the lowest pipeline stage holding
it. Reading takes each logical tensor whole from the checkpoint and keeps this rank's part
of it, so the layout that saved and the layout that loads are independent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain import tensor_parallel
from dtrain.checkpoint.universal import MODEL, OPTIM, Checkpoint, Piece, pieces_of
from dtrain.comm import GroupLike
from dtrain.data_parallel.zero import ZeRO
from dtrain.data_parallel.zero import state_io as zero_state
from dtrain.errors import DtrainError
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.models.moe import split_experts
from dtrain.models.moe.experts import EXPERTS
from dtrain.split import Split

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from dtrain.models.weights import SlicedWeights


def _scalar(value: torch.Tensor | float) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def expert_group(mesh: Mesh) -> GroupLike:
    """Under expert parallelism, the group of the ranks holding the same experts as this one,
    over which the experts' gradients average (mesh group "edp_cp"); None without ep."""
    return mesh.group("edp_cp") if mesh.size("ep") > 1 else None


@dataclass
class Names:
    """How this rank's parameters map to the logical tensors of the whole model.

    Args:
        whole: the complete model this rank built (names, ties, tensor-parallel splits).
        tp: (tp rank, tp size) of this rank.
        skip: ids of parameters another rank writes and counts (a tied weight's copy on a
            later pipeline stage).
        ep: (ep rank, ep size): which E / ep of every MoE layer's experts this rank holds
            (dtrain.models.moe.split_experts), by global index.
        edp: (rank, size) among the ranks holding the same experts (mesh group "edp_cp":
            ep is folded over dp_shard x cp x tp, so they may be other cp or tp ranks).
        twins: id of a parameter -> the one it copies (a tied weight's twin where one
            pipeline rank holds both ends: dtrain.pipeline.tied_weights), named as it.
    """

    whole: nn.Module
    tp: tuple[int, int] = (0, 1)
    skip: set[int] = field(default_factory=set)
    ep: tuple[int, int] = (0, 1)
    edp: tuple[int, int] = (0, 1)
    twins: dict[int, nn.Parameter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.canonical = {id(p): n for n, p in self.whole.named_parameters()}
        self.canonical.update({twin: self.canonical[id(p)] for twin, p in self.twins.items()})
        named = dict(self.whole.named_parameters(remove_duplicate=False))
        self.split: dict[int, Split] = {
            id(named[n]): split for n, (split, _) in tensor_parallel.placements(self.whole).items()
            if n in named}
        self.experts = {id(p) for p in split_experts(self.whole)}

    @classmethod
    def of(cls, whole: nn.Module, mesh: Mesh, skip: set[int] | None = None,
           twins: dict[int, nn.Parameter] | None = None) -> Names:
        """The names of `whole` held at this rank's place on `mesh` (`skip`, `twins`: as
        the constructor's)."""
        return cls(whole, tp=mesh.place("tp"), skip=skip or set(), ep=mesh.place("ep"),
                   edp=mesh.place("edp_cp") if mesh.size("ep") > 1 else (0, 1),
                   twins=twins or {})

    def aliases(self) -> dict[str, str]:
        """Other names of tied parameters -> their canonical name."""
        return {n: self.canonical[id(p)] for n, p in
                self.whole.named_parameters(remove_duplicate=False)
                if self.canonical[id(p)] != n}

    def is_split(self, p: nn.Parameter) -> bool:
        """Whether `p` differs between the tp ranks, so that its squares sum over tp and
        every tp rank writes its own: a tensor-parallel block, or split experts where tp
        > 1 (ep is folded over tp first: dtrain.mesh.dims)."""
        return id(p) in self.split or (id(p) in self.experts and self.tp[1] > 1)

    def sharers(self, p: nn.Parameter, dp: tuple[int, int]) -> tuple[int, int]:
        """(rank, size) among the ranks that hold the same values of `p` and split its
        writing: the data-parallel ranks `dp`, or for split experts those holding the same
        experts."""
        return self.edp if id(p) in self.experts else dp

    def counted(self, p: nn.Parameter) -> bool:
        """Whether this rank counts `p` in the global gradient norm (not a tied copy)."""
        return id(p) not in self.skip

    def writes(self, p: nn.Parameter) -> bool:
        """Whether this rank writes (its tp block of, or its share of its experts in) `p`:
        replicated tensors come from tp rank 0 only, a tied copy from the lowest stage
        only."""
        return self.counted(p) and (self.is_split(p) or self.tp[0] == 0)

    def placement(self, p: nn.Parameter) -> tuple[int, int, Split | None]:
        """(part, parts, split): which block of its tensor `p` is: a tensor-parallel block,
        or split experts (this rank's E / ep of them, by global index, along dim 0)."""
        split = self.split.get(id(p))
        if split is not None:
            return (*self.tp, split)
        if id(p) in self.experts:
            return (*self.ep, EXPERTS)
        return (0, 1, None)

    def local(self, ckpt: Checkpoint | SlicedWeights, name: str, p: nn.Parameter
              ) -> torch.Tensor:
        """This rank's block of the logical tensor `name` (p's shape)."""
        part, parts, split = self.placement(p)
        if split is None:
            block = ckpt.tensor(name)
        elif _reads_slices(ckpt, "block"):  # a source that reads a slice (models.weights)
            block = ckpt.block(name, split, part, parts)
        else:
            block = split.shard(ckpt.tensor(name), part, parts)
        _check_shape(ckpt, name, block.shape, p)
        return block

    def fill_(self, ckpt: Checkpoint | SlicedWeights, name: str, p: nn.Parameter) -> None:
        """Copy this rank's block of `name` into `p`; a source that reads slices
        (models.weights) writes it a few rows at a time, never the block whole beside p."""
        if not _reads_slices(ckpt, "copy_into"):
            p.copy_(self.local(ckpt, name, p))
            return
        part, parts, split = self.placement(p)
        shape = ckpt.shape(name) if split is None else split.block_shape(ckpt.shape(name),
                                                                          parts)
        _check_shape(ckpt, name, shape, p)
        ckpt.copy_into(p, name, split, part, parts)

    def spans(self, ckpt: Checkpoint | SlicedWeights, name: str, p: nn.Parameter, lo: int,
              hi: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Elements lo..hi of this rank's block of `name`, flattened (a ZeRO shard's span),
        as (a, b, elements a..b) pieces read in turn; a source that reads rows
        (models.weights) reads only the rows holding them, one group of rows a piece."""
        if self.placement(p)[2] is not None or not _reads_slices(ckpt, "rows"):
            yield lo, hi, self.local(ckpt, name, p).reshape(-1)[lo:hi]
            return
        _check_shape(ckpt, name, ckpt.shape(name), p)
        for a, b in ckpt.row_cuts(name, lo, hi):
            yield a, b, ckpt.rows(name, a, b)


def _reads_slices(ckpt: Checkpoint | SlicedWeights, method: str) -> TypeIs[SlicedWeights]:
    """Whether `ckpt` is a source that reads slices of its tensors (models.weights), as its
    having `method` tells."""
    return hasattr(ckpt, method)


def _check_shape(ckpt: Checkpoint | SlicedWeights, name: str, shape: tuple[int, ...],
                 p: nn.Parameter) -> None:
    if tuple(shape) != tuple(p.shape):
        raise DtrainError(f"checkpoint {ckpt.path}: {name} has shape {tuple(shape)} there but "
                          f"this model needs {tuple(p.shape)}: it was saved from another "
                          "model config")


def optimizer_keys(ckpt: Checkpoint | SlicedWeights) -> dict[str, list[str]]:
    """Per logical tensor, the names of its per-element optimizer state in `ckpt`."""
    keys = defaultdict(list)
    for n in ckpt.names(OPTIM):
        param, _, key = n.rpartition("/")
        keys[param].append(key)
    return keys


@dataclass
class Tensors:
    """Parameters held as tensors (whole or tp blocks), with their torch optimizer (None:
    the optimizer lives elsewhere, as on parameter servers); dp (rank, size) splits the
    writing of the data-parallel copies' identical values."""

    names: Names
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None = None
    dp: tuple[int, int] = (0, 1)

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def collect(self, pieces: list[Piece], scalars: dict[str, dict[str, float]],
                only: Collection[str] | None = None) -> None:
        """Add this rank's pieces (parameters and per-element optimizer state) and its
        optimizer scalars (e.g. Adam's step) by parameter name; `only`: of these
        parameters alone (None: all)."""
        names = self.names
        for p in self.params:
            name = names.canonical[id(p)]
            if not names.writes(p) or (only is not None and name not in only):
                continue
            dp = names.sharers(p, self.dp)
            part, parts, split = names.placement(p)
            pieces += pieces_of(MODEL + name, p, *dp, part, parts, split)
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim():
                    pieces += pieces_of(f"{OPTIM}{name}/{key}", value, *dp, part, parts,
                                        split)
                elif value is not None:
                    scalars.setdefault(name, {})[key] = _scalar(value)

    @torch.no_grad()
    def restore(self, ckpt: Checkpoint | SlicedWeights) -> None:
        """Set the parameters (and optimizer state) from `ckpt`, whatever its layout."""
        names, scalars, keys = self.names, ckpt.extra.get("scalars", {}), optimizer_keys(ckpt)
        for p in self.params:
            name = names.canonical[id(p)]
            names.fill_(ckpt, MODEL + name, p)
            if self.optimizer is not None and (keys[name] or name in scalars):
                state = {key: names.local(ckpt, f"{OPTIM}{name}/{key}", p).to(p.dtype).clone()
                         for key in keys[name]}
                for key, value in scalars.get(name, {}).items():
                    state[key] = torch.tensor(value, dtype=torch.float32)
                self.optimizer.state[p] = state


@dataclass
class Shards:
    """Parameters held as ZeRO shards by one ZeRO wrapper (with its sharded optimizer);
    `writes` False on a replica other than the first under hybrid sharding, which holds
    the same shards as the first and writes none of them."""

    names: Names
    zero: ZeRO
    writes: bool = True

    def _own(self) -> dict[str, nn.Parameter]:
        return dict(self.zero.module.named_parameters())

    def step(self) -> None:
        self.zero.step()  # its shards, then (stages 1-2) all-gathers the parameters

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    @torch.no_grad()
    def collect(self, pieces: list[Piece], scalars: dict[str, dict[str, float]],
                only: Collection[str] | None = None) -> None:
        """Add this rank's shards of parameters and optimizer state, and the scalars;
        `only`: of these parameters alone (None: all)."""
        names, own = self.names, self._own()

        def writes(p: nn.Parameter) -> bool:
            return names.writes(p) and (only is None or names.canonical[id(p)] in only)

        if not self.writes:
            return
        shard = zero_state.sharded_state(self.zero)
        for k, group in enumerate(self.zero.layout):
            for n in group:
                if writes(own[n]) and shard["scalars"][k]:
                    scalars[names.canonical[id(own[n])]] = {
                        key: _scalar(v) for key, v in shard["scalars"][k].items()}
        per_key = {"": shard["params"], **{f"/{key}": segs for key, segs in
                                            shard["state"].items()}}
        for suffix, segments in per_key.items():
            for n, segs in segments.items():
                p = own[n]
                if not writes(p):
                    continue
                name = f"{OPTIM if suffix else MODEL}{names.canonical[id(p)]}{suffix}"
                pieces += [Piece.of_block(name, p.shape, values.to(torch.float32), lo,
                                          *names.placement(p)) for lo, _, values in segs]

    @torch.no_grad()
    def restore(self, ckpt: Checkpoint | SlicedWeights) -> None:
        """Set this rank's shards (and their optimizer state) from `ckpt`."""
        names, own = self.names, self._own()
        scalars, keys = ckpt.extra.get("scalars", {}), optimizer_keys(ckpt)
        ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        state: dict[str, zero_state.Segments] = defaultdict(lambda: defaultdict(list))
        for n, lo, hi in zero_state.span_ranges(self.zero):
            p, name = own[n], names.canonical[id(own[n])]
            ranges[n].append((lo, hi))
            for key in keys[name]:
                block = names.local(ckpt, f"{OPTIM}{name}/{key}", p).reshape(-1)
                state[key][n].append((lo, hi, block[lo:hi]))
        group_scalars = [{key: torch.tensor(v, dtype=torch.float32) for key, v in
                          scalars.get(names.canonical[id(own[group[0]])], {}).items()}
                         if group else {} for group in self.zero.layout]
        params = _Spans(ranges, lambda n, lo, hi: names.spans(
            ckpt, MODEL + names.canonical[id(own[n])], own[n], lo, hi))
        zero_state.load_segments(self.zero, params, state, group_scalars, None)


class _Spans(Mapping[str, Iterator[tuple[int, int, torch.Tensor]]]):
    """Parameter name -> its [(lo, hi, its elements lo..hi)], read as iterated and not
    kept: restoring a shard holds one piece of one parameter's span at a time, not a
    second copy of it."""

    def __init__(self, ranges: dict[str, list[tuple[int, int]]],
                 read: Callable[[str, int, int], Iterator[tuple[int, int, torch.Tensor]]]
                 ) -> None:
        self.ranges, self.read = ranges, read

    def __getitem__(self, name: str) -> Iterator[tuple[int, int, torch.Tensor]]:
        return self._pieces(name, self.ranges[name])  # a name not held: KeyError, at once

    def _pieces(self, name: str, ranges: list[tuple[int, int]]
                ) -> Iterator[tuple[int, int, torch.Tensor]]:
        for lo, hi in ranges:
            for piece in self.read(name, lo, hi):
                yield piece
                del piece  # let go before the next is read

    def __iter__(self) -> Iterator[str]:
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)


@dataclass
class FrozenShards:
    """Parameters that never change (a LoRA run's base) held as ZeRO-3 shards beside the
    trained ones (`ZeRO(..., frozen=...)`): no optimizer, nothing to step."""

    names: Names
    zero: ZeRO
    writes: bool = True
    """False on a replica other than the first (hybrid sharding), as Shards'."""

    def _own(self) -> dict[str, nn.Parameter]:
        return dict(self.zero.module.named_parameters())

    def step(self) -> None:
        """Nothing: they do not train."""

    def zero_grad(self) -> None:
        """Nothing: they have no gradient."""

    @torch.no_grad()
    def collect(self, pieces: list[Piece], scalars: dict[str, dict[str, float]],
                only: Collection[str] | None = None) -> None:
        """Add this rank's shards of them (`only`: of these parameters alone)."""
        names, own = self.names, self._own()
        if not self.writes:
            return
        for n, segs in zero_state.master_segments(self.zero, frozen=True).items():
            p = own[n]
            if not names.writes(p) or (only is not None and names.canonical[id(p)] not in only):
                continue
            pieces += [Piece.of_block(MODEL + names.canonical[id(p)], p.shape,
                                      values.to(torch.float32), lo, *names.placement(p))
                       for lo, _, values in segs]

    @torch.no_grad()
    def restore(self, ckpt: Checkpoint | SlicedWeights) -> None:
        """Set this rank's shards of them from `ckpt` (the next forward gathers them)."""
        names, own = self.names, self._own()
        ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for n, lo, hi in zero_state.span_ranges(self.zero, frozen=True):
            ranges[n].append((lo, hi))
        zero_state.load_frozen(self.zero, _Spans(ranges, lambda n, lo, hi: names.spans(
            ckpt, MODEL + names.canonical[id(own[n])], own[n], lo, hi)))


def untrained(names: Names, modules: Iterable[nn.Module], dp: tuple[int, int],
              device: torch.device, apart: Collection[int] = ()) -> list[Tensors]:
    """The parameters of `modules` that no optimizer steps (a MoE router's balancing bias,
    a LoRA run's frozen base), beside ZeRO, which shards trainable parameters only (and
    at stage 3 the frozen base: their ids `apart`): held whole on every rank, given
    memory on `device` when built in split form, written and restored as tensors (none:
    an empty list)."""
    params = [p for m in modules for p in m.parameters()
              if not p.requires_grad and id(p) not in apart]
    init.allocate_parameters(params, device)
    return [Tensors(names, params, None, dp)] if params else []


Part = Tensors | Shards | FrozenShards
"""One way a rank holds some of its parameters (its Holding's `parts`)."""


def collect(parts: Iterable[Part], only: Collection[str] | None = None
            ) -> tuple[list[Piece], dict[str, Any]]:
    """Every piece this rank writes, and the optimizer scalars, as dtrain.checkpoint saves
    them; `only`: of these parameters alone (canonical names; None: all)."""
    pieces: list[Piece] = []
    scalars: dict[str, dict[str, float]] = {}
    for part in parts:
        part.collect(pieces, scalars, only)
    return pieces, {"scalars": scalars}
