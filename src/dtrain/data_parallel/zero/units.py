"""The flat units on one rank: which parameters each packs, and its buffers.

A unit (dtrain.data_parallel.zero.flat.FlatUnit) lays some parameters end to end in one flat buffer
cut into one equal shard per rank. `Unit` adds this rank's tensors for it: the full buffer
the module's parameters view, this rank's master shard, and the gradient buffers.
`build_units` packs a module's trainable parameters into units for a ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain import comm
from dtrain.comm.collectives import Result
from dtrain.comm.quantized import DEFAULT_BLOCK, Decoding, WireDtype
from dtrain.data_parallel.zero.flat import FlatUnit, Span, split_by_size
from dtrain.errors import DtrainError
from dtrain.models.compiled import gradients_together

Named = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Wires:
    """The dtypes a unit's collectives travel in (dtrain.comm.quantized: ZeRO++'s qwZ and
    qgZ); None sends the compute dtype as it is.

    Attributes:
        gather: the weights' all-gathers ("bf16", "fp8", "int8"): every rank dequantizes
            every shard, its own too, so all compute with the same weights; the master
            shards stay exact.
        reduce: the gradients' reduce-scatters ("fp32", "bf16", "int8"); a wire narrower
            than the compute dtype keeps what it dropped in the unit's `residual` and
            sends it with the next step's gradient (error feedback).
        block: elements per scale of an int8 or fp8 wire.
    """

    gather: str | None = None
    reduce: str | None = None
    block: int = DEFAULT_BLOCK

    def lossy_reduce(self, compute: torch.dtype) -> bool:
        """Whether the reduce wire drops precision the compute dtype has."""
        if self.reduce is None:
            return False
        wire = WireDtype.parse(self.reduce)
        return wire.blockwise or wire.itemsize < compute.itemsize


@dataclass(eq=False)  # a unit is itself (`unit in units` by identity)
class Unit:
    """One flat unit's tensors on this rank.

    Attributes:
        flat: the layout: parameters, their offsets, the shards (dtrain.data_parallel.zero.flat).
        group: the ranks the unit is sharded over, one shard each (the data-parallel
            group; for split experts, the ranks holding the same experts).
        scale: what the gradient averaged over `group` is multiplied by (split experts:
            1 / ep, as their gradients sum the tokens of every data-parallel rank).
        full: the whole unit in the compute dtype, padded; the module's parameters are
            views of it (stage 3: its storage is released between uses; built in split
            form, it is `unallocated` until the first gather).
        master: this rank's shard in the parameters' dtype (the optimizer updates it; a
            view of `full` when no copy is needed).
        module: stage 3: the submodule whose forward gathers the unit (None otherwise).
        grad: the unsharded gradient being accumulated (compute dtype), or None; made at
            the first backward (`grad_buffer`), and stage 1 keeps it from then on; stage 3
            makes it when the unit's backward ends (`pack_grads`).
        pending: parameters whose gradient the current backward has not produced yet.
        gathering: stage 3: the all-gather into `full` in flight, if any.
        gathered: whether `full` holds the parameters now.
        backward_started: stage 3: whether this backward has gathered the unit already.
        pieces: (optimizer parameter group, lo, hi, the optimizer's parameter): where each
            group meets this rank's shard; the optimizer's parameters are views of `master`.
        grad_shard: the gradient of `master`, reduced over the group (None until used),
            on the compute device.
        offloaded: whether `master` (and the optimizer's pieces of it) is in host memory
            (dtrain.data_parallel.zero.offload): then the pieces' .grad are host copies of
            `grad_shard`, set by the offloaded step.
        resident: offloaded stage 3: this rank's shard on the compute device, in the
            compute dtype, which the gathers read (the master being on the host).
        wires: the dtypes its gathers and reduce-scatters travel in.
        residual: with a lossy reduce wire, what the last reduce-scatters' quantization
            dropped (fp32, the whole unit), added to the next one's gradient.
    """

    flat: FlatUnit
    group: comm.Group
    full: torch.Tensor
    master: torch.Tensor
    module: nn.Module | None = None
    scale: float = 1.0
    grad: torch.Tensor | None = None
    pending: int = 0
    gathering: Any = None
    gathered: bool = True
    backward_started: bool = False
    pieces: list[tuple[int, int, int, nn.Parameter]] = field(default_factory=list)
    grad_shard: torch.Tensor | None = None
    offloaded: bool = False
    resident: torch.Tensor | None = None
    wires: Wires = field(default_factory=Wires)
    residual: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """This rank's shard of the unit (its index in `group`)."""
        return self.group.rank

    @property
    def master_in_full(self) -> bool:
        """Whether `master` is `full`'s own part (made as a view of it where no copy is
        needed): then it holds no memory of its own, and the refresh all-gathers in
        place. Asked of the storage, which stage 3 may have released."""
        return torch._C._is_alias_of(self.master, self.full)  # type: ignore[attr-defined]  # not in torch's stubs

    def shard_grad(self) -> torch.Tensor:
        """The gradient shard, created (zero) on first use; the pieces' .grad view it
        (unless offloaded)."""
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.master.shape, dtype=self.master.dtype,
                                          device=self.full.device)
            for _, lo, hi, piece in [] if self.offloaded else self.pieces:
                piece.grad = self.grad_shard[lo:hi]
        return self.grad_shard

    def drop_grad_shard(self) -> None:
        """Release the gradient shard (and the pieces' .grad views of it)."""
        self.grad_shard = None
        for *_, piece in self.pieces:
            piece.grad = None

    def reset_backward(self) -> None:
        """Ready for the next backward: every parameter's gradient still to come."""
        self.pending = len(self.flat.params)
        self.backward_started = False

    def start_gather(self, algorithm: str) -> None:
        """Stage 3: start all-gathering every rank's master shard straight into `full`,
        whose memory is made here, in the caller's thread: a unit gathered or prefetched
        holds one copy of itself from the moment its gather starts, never a second."""
        if self.gathered or self.gathering is not None:
            return
        if self.full.stride(0) == 0:  # built in split form and never gathered: no memory yet
            self._allocate_full()
        else:
            self.full.untyped_storage().resize_(self.flat.padded * self.full.element_size())
        if self.wires.gather is not None:  # quantized from the master itself
            shard = self.resident if self.resident is not None else self.master
            self.gathering = comm.quantized_all_gather(
                shard, self.wires.gather, group=self.group, async_op=True,
                algorithm=algorithm, out=self.full, block=self.wires.block)
            return
        shard = self.resident if self.resident is not None else self.master.to(self.full.dtype)
        self.gathering = comm.all_gather(shard, group=self.group, async_op=True,
                                         algorithm=algorithm, out=self.full)

    @torch.no_grad()
    def gather(self, algorithm: str) -> None:
        """Stage 3: make `full` hold the parameters again (waits for the all-gather)."""
        if self.gathered:
            return
        self.start_gather(algorithm)
        self.gathering.wait()
        self.gathering = None
        self.gathered = True

    def _allocate_full(self) -> None:
        """`full` in memory of its own, the parameters views of it from now on (until now
        they saw `unallocated`'s one element)."""
        self.full = torch.empty(self.flat.padded, dtype=self.full.dtype,
                                device=self.full.device)
        for p, offset in zip(self.flat.params, self.flat.offsets, strict=True):
            p.data = self.full[offset : offset + p.numel()].view(p.shape)

    def free(self) -> None:
        """Stage 3: release `full`'s memory until the next gather (a prefetch that no
        forward or backward used is waited for first: it writes into `full`)."""
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
            self.gathered = True
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def shard_spans(self) -> Iterator[tuple[Span, nn.Parameter]]:
        """(span, parameter) for each parameter's elements that this rank's shard holds;
        `span.at` is in shard coordinates (see `segment`)."""
        params = dict(zip(self.flat.names, self.flat.params, strict=True))
        for span in self.flat.spans(*self.flat.shard(self.rank)):
            yield span, params[span.name]

    def reduce_scatter(self, grad: torch.Tensor, algorithm: str
                       ) -> Result[torch.Tensor] | Decoding[torch.Tensor]:
        """Start averaging `grad` (the whole unit's) over `group` in `wires.reduce`; the
        handle's `wait()` is this rank's shard."""
        if self.wires.reduce is None:
            return comm.reduce_scatter(grad, op="avg", group=self.group, async_op=True,
                                       algorithm=algorithm)
        if self.wires.lossy_reduce(grad.dtype) and self.residual is None:
            self.residual = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        return comm.quantized_reduce_scatter(grad, self.wires.reduce, op="avg",
                                             group=self.group, async_op=True,
                                             algorithm=algorithm, block=self.wires.block,
                                             residual=self.residual)

    def grad_buffer(self) -> torch.Tensor:
        """`grad`, created as zeros (the whole unit, padded, in the compute dtype) if it
        does not exist yet: at the first backward, not when the unit is built."""
        if self.grad is None:
            self.grad = torch.zeros(self.flat.padded, dtype=self.full.dtype,
                                    device=self.full.device)
        return self.grad

    @torch.no_grad()
    def pack_grads(self) -> None:
        """Stage 3: add the gradients autograd left in the parameters' `.grad` (there while
        the unit's backward runs) into `grad`, and release them."""
        for p, offset in zip(self.flat.params, self.flat.offsets, strict=True):
            if p.grad is not None:
                self.grad_buffer()[offset : offset + p.numel()].add_(p.grad.reshape(-1))
                p.grad = None

    def param_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The view of `grad` (created as zeros if needed) that holds `param`'s gradient;
        None when `param` is not one of the unit's parameters."""
        for p, offset in zip(self.flat.params, self.flat.offsets, strict=True):
            if p is param:
                return self.grad_buffer()[offset : offset + p.numel()].view(p.shape)
        return None


IN_FLIGHT = 2
"""Collectives of whole units a loop leaves running before it waits for the oldest: stages
1-2's reduce-scatters in backward (overlap with the next units' backward, memory of two
units' gradients) and their refresh's all-gathers after the step."""


@dataclass
class Reducing:
    """A unit's reduce-scatter in flight and the gradient buffer it reads. The buffer is
    held here until the collective is waited for, so that it is released where the
    backward waits (`settle`), the same point in every run, not whenever the
    collective's thread happens to finish."""

    unit: Unit
    work: Any
    buffer: torch.Tensor


def add_reduced(unit: Unit, reduced: torch.Tensor) -> None:
    """Add a unit's reduced gradient shard to what its shard gradient holds."""
    unit.shard_grad().add_(reduced, alpha=unit.scale)


def settle(works: list[Reducing], keep: int = IN_FLIGHT,
           arrive: Callable[[Unit, torch.Tensor], None] = add_reduced) -> None:
    """Wait for all but the `keep` latest of `works` and hand each one's result to `arrive`
    (by default added to the unit's shard gradient; under hybrid sharding first averaged
    across the replicas): a unit's whole gradient is kept until its collective has read
    it, so a bounded number in flight bounds backward's memory."""
    while len(works) > keep:
        done = works.pop(0)
        reduced, unit = done.work.wait(), done.unit
        del done  # the buffer, read, goes before the shard gradient (if new) comes
        arrive(unit, reduced)
        if unit.grad is not None:  # stage 1 keeps its buffer for the next step
            unit.grad.zero_()


def segment(shard: torch.Tensor, span: Span) -> torch.Tensor:
    """The part of a shard-shaped tensor that `span` locates (a view)."""
    return shard[span.at : span.at + span.hi - span.lo]


def one_dtype(named: Named) -> torch.dtype:
    """The parameters' one dtype.

    Raises:
        DtrainError: the parameters have several dtypes.
    """
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise DtrainError(f"ZeRO: parameters of several dtypes {sorted(map(str, dtypes))}; "
                          "cast the model to one dtype")
    return dtypes.pop()


def unit_bytes(units: list[Unit]) -> dict[str, int]:
    """Bytes the units hold now: "params" (`full`, as materialized), "master" (shards
    that are not views of `full`) and "grads" (gradient shards and unsharded buffers)."""
    params = sum(u.full.untyped_storage().nbytes() for u in units)
    masters = sum(u.master.numel() * u.master.element_size() for u in units
                  if not u.master_in_full)
    grads = sum((u.grad_shard.numel() * u.grad_shard.element_size()
                 if u.grad_shard is not None else 0)
                + (u.grad.numel() * u.grad.element_size() if u.grad is not None else 0)
                for u in units)
    return {"params": params, "master": masters, "grads": grads}


@dataclass
class Built:
    """Units in the order their gradients are reduced (the reverse of forward), and for
    stage 3 the root's units (what no submodule unit claims), each unit module's units
    in forward order (one per sharding group its parameters are in), and the frozen
    units among root's and chain's (parameters that do not train: sharded, gathered
    and freed like the others, never reduced or stepped)."""

    units: list[Unit]
    root: list[Unit]
    chain: list[list[Unit]]
    frozen: list[Unit] = field(default_factory=list)


@dataclass(frozen=True)
class Sharding:
    """The groups a module's parameters are sharded over: `group` for all of them but
    `apart` (ids of split experts), which go over `apart_group` (the ranks holding the
    same experts), their average multiplied by `apart_scale`."""

    group: comm.Group
    apart: frozenset[int] = frozenset()
    apart_group: comm.Group | None = None
    apart_scale: float = 1.0

    def runs(self, named: Named) -> list[tuple[Named, comm.Group, float]]:
        """`named` cut into consecutive runs of one group each (order kept), with the
        group and the scale of each."""
        out: list[tuple[Named, comm.Group, float]] = []
        for name, p in named:
            if id(p) in self.apart:
                assert self.apart_group is not None  # given with `apart`
                group, scale = self.apart_group, self.apart_scale
            else:
                group, scale = self.group, 1.0
            if out and out[-1][1] is group:
                out[-1][0].append((name, p))
            else:
                out.append(([(name, p)], group, scale))
        return out


def build_units(module: nn.Module, named: Named, group_of: dict[int, int], stage: int,
                units: list[nn.Module] | None, bucket_mb: float, sharding: Sharding,
                param_dtype: torch.dtype, compute_dtype: torch.dtype,
                device: torch.device | None = None, frozen: Named | None = None,
                wires: Wires | None = None) -> Built:
    """Pack `named` (trainable parameters) into units: stage 3 one per submodule of
    `units` (default every element of every nn.ModuleList) plus the root; stages 1-2
    buckets of about `bucket_mb` in reverse order, each compiled block's in buckets of its
    own (their gradients come at once: dtrain.models.compiled `gradients_together`). Each
    sharding group of `sharding` gets units of its own.
    `group_of` maps id(parameter) to its optimizer parameter group. The parameters become
    views of the units' `full`. Stage 3 packs `frozen` (parameters that do not train, of
    one dtype) into units of their own beside each module's.

    Parameters on the meta device (a model built in split form, dtrain.models.init) get
    uninitialized memory on `device` instead of copies: at stage 3 only this rank's shard
    (`full` has no memory until its first gather), the values to be restored into the
    shards. `wires`: the dtypes the units' collectives travel in; a quantized gather gives
    every unit a master shard of its own (the gathered `full` holds what every rank
    dequantized, not the exact shard)."""
    def make(run: Named, group: comm.Group, scale: float, unit_module: nn.Module | None
             ) -> Unit:
        run = sorted(run, key=lambda item: group_of[id(item[1])])
        flat = FlatUnit([n for n, _ in run], [p for _, p in run],
                        [group_of[id(p)] for _, p in run], group.size)
        return _make_unit(flat, group, scale, unit_module, stage, param_dtype, compute_dtype,
                          device, wires or Wires())

    if stage != 3:
        together = gradients_together(module)
        built = [make(bucket, group, scale, None)
                 for run, group, scale in sharding.runs(list(reversed(named)))
                 for bucket in split_by_size(run, int(bucket_mb * 2**20), together)]
        return Built(built, [], [])
    still = frozen or []
    frozen_dtype = one_dtype(still) if still else param_dtype
    frozen_compute = compute_dtype if compute_dtype != param_dtype else frozen_dtype

    def make_frozen(run: Named, group: comm.Group, unit_module: nn.Module) -> Unit:
        flat = FlatUnit([n for n, _ in run], [p for _, p in run], [0] * len(run), group.size)
        return _make_unit(flat, group, 1.0, unit_module, stage, frozen_dtype, frozen_compute,
                          device, wires or Wires())

    per_module = [[make(run, group, scale, unit_module)
                   for run, group, scale in sharding.runs(module_named)]
                  for module_named, unit_module in _module_runs(module, named, units)]
    per_frozen = [[make_frozen(run, group, unit_module)
                   for run, group, _ in sharding.runs(module_named)]
                  for module_named, unit_module in _module_runs(module, still, units)]
    held = [trained + kept for trained, kept in zip(per_module, per_frozen, strict=True)]
    return Built([u for units_of in reversed(per_module) for u in reversed(units_of)],
                 held[0], [u for u in held[1:] if u],
                 [u for kept in per_frozen for u in kept])


def _module_runs(module: nn.Module, named: Named, units: list[nn.Module] | None
                 ) -> list[tuple[Named, nn.Module]]:
    """Stage 3: (parameters, module) per unit, the root (what no unit claims, maybe
    nothing) first, then the units in forward order."""
    if units is None:
        units = [m for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    owner: dict[int, int] = {}
    for k, m in enumerate(units):
        for p in m.parameters():
            if id(p) in owner and owner[id(p)] != k:
                raise DtrainError("ZeRO stage 3: a parameter is shared by two units; "
                                  "make them one unit")
            owner[id(p)] = k
    runs = [([(n, p) for n, p in named if id(p) not in owner], module)]
    for k, m in enumerate(units):
        runs.append(([(n, p) for n, p in named if owner.get(id(p)) == k], m))
    return runs


@torch.no_grad()
def _make_unit(flat: FlatUnit, group: comm.Group, scale: float, module: nn.Module | None,
               stage: int, param_dtype: torch.dtype, compute_dtype: torch.dtype,
               device: torch.device | None = None, wires: Wires = Wires()) -> Unit:
    own = compute_dtype != param_dtype or stage == 3 or wires.gather is not None
    lo, hi = flat.shard(group.rank)
    if flat.params[0].is_meta:
        unit = _empty_unit(flat, group, scale, module, stage, lo, hi, param_dtype,
                           compute_dtype, device or torch.device("cpu"), own)
        unit.wires = wires
        return unit
    mixed = compute_dtype != param_dtype
    values = torch.zeros(flat.padded, dtype=param_dtype, device=flat.params[0].device)
    for p, offset in zip(flat.params, flat.offsets, strict=True):
        values[offset : offset + p.numel()] = p.detach().reshape(-1)
    full = values if not mixed else values.to(compute_dtype)
    master = values[lo:hi].clone() if own else values[lo:hi]
    for p, offset in zip(flat.params, flat.offsets, strict=True):
        p.data = full[offset : offset + p.numel()].view(p.shape)
    return Unit(flat, group, full, master, module, scale, wires=wires)


def _empty_unit(flat: FlatUnit, group: comm.Group, scale: float, module: nn.Module | None,
                stage: int, lo: int, hi: int, param_dtype: torch.dtype,
                compute_dtype: torch.dtype, device: torch.device, own: bool) -> Unit:
    """A unit of meta parameters: memory for what this rank holds, values to come. Stages
    1 and 2 hold every parameter, views of `full`; stage 3 only its shard: `full` and the
    parameters are `unallocated` until the unit is first gathered, so that no rank ever
    holds a whole unit while the model is built. `own`: the master shard is a tensor of
    its own, not a view of `full`."""
    if stage == 3:
        full = unallocated(flat.padded, compute_dtype, device)
    else:
        full = torch.empty(flat.padded, dtype=compute_dtype, device=device)
    if own:
        master = torch.zeros(hi - lo, dtype=param_dtype, device=device)
    else:
        master = full[lo:hi]
    for p, offset in zip(flat.params, flat.offsets, strict=True):
        shape = p.shape  # the same object, made real, then a view of `full` as usual
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                                                 requires_grad=p.requires_grad))
        p.data = full[offset : offset + shape.numel()].view(shape)
    if stage == 3:  # the views made, `full` holds nothing until its first gather
        full.untyped_storage().resize_(0)
    return Unit(flat, group, full, master, module, scale, gathered=stage != 3)


def unallocated(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `numel` elements over the memory of one: that element seen at every
    index (stride 0). torch makes a tensor, or a view, only over storage at least as large
    as it, and a shape is all the parameters need before their first gather; so the views
    are taken of this, its storage then released, and `Unit.gather` allocates the unit
    the first time."""
    return torch.empty(1, dtype=dtype, device=device).expand(numel)
