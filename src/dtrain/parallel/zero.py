"""Sharded data parallelism (ZeRO stages 1, 2 and 3): each rank keeps 1/N of the state.

Plain data parallelism keeps a full copy of the parameters, gradients and optimizer state
on every rank. ZeRO (Rajbhandari et al., 2020) splits them across the N ranks of the
data-parallel group instead. Parameters are packed into flat *units*
(dtrain.parallel.flat) whose shard r belongs to rank r:

- stage 1: each rank keeps optimizer state (and the fp32 master weights) for its shard
  only. Gradients are reduce-scattered, not allreduced, so each rank receives the summed
  gradient of just the shard it updates; after the step the updated shards are
  all-gathered back into every rank's full parameters.
- stage 2: as stage 1, and a unit's full gradient buffer is released as soon as it has
  been reduce-scattered, during backward (units are buckets of about `bucket_mb`).
- stage 3: the parameters themselves are sharded. A unit (a submodule: by default every
  element of an nn.ModuleList, such as transformer blocks, plus the rest of the model as
  the root unit) is all-gathered just before its forward and again before its backward,
  the next unit's gather is started while the current one computes, and its memory is
  released right after.

Per-rank memory of model state, for Ψ parameters, N ranks and K bytes of optimizer
state per parameter (Adam: 8; plus 4 for fp32 master weights under mixed precision):
stage 1: 2·p·Ψ + KΨ/N, stage 2: p·Ψ + (p + K)Ψ/N, stage 3: (2p + K)Ψ/N (p: bytes per
parameter in the compute dtype; the paper's formulas with p = 2 and K = 12).

Usage (every rank):

    model = dtrain.ZeRO(net, lambda params: torch.optim.AdamW(params, lr=3e-4), stage=2)
    loss = model(x, y)
    model.backward(loss)          # loss.backward() also works, except with fp16
    model.clip_grad_norm_(1.0)    # the global norm, across shards
    model.step()
    model.zero_grad()

The optimizer factory is called once with the module's parameters; it may build
parameter groups with their own options. dtrain reads the groups and options from it,
then builds the same optimizer class with the same options over this rank's shard pieces
(`model.optimizer`, for learning-rate schedulers). Parameters that no rank used in a step
get a zero gradient (in one process their gradient would stay None and the optimizer
would skip them).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dtrain import comm
from dtrain.errors import DtrainError
from dtrain.parallel import zero_state
from dtrain.parallel.data_parallel import parse_dtype
from dtrain.parallel.flat import FlatUnit, split_by_size
from dtrain.parallel.replicas import broadcast_state, check_same_model

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

GROWTH_INTERVAL = 2000  # fp16: steps without overflow before the loss scale doubles


@dataclass
class _Unit:
    """One flat unit's tensors on this rank."""

    flat: FlatUnit
    full: torch.Tensor  # compute dtype, padded; the module's parameters are views of it
    master: torch.Tensor  # this rank's shard in the master dtype
    module: nn.Module | None = None  # stage 3: the submodule whose forward gathers it
    grad: torch.Tensor | None = None  # unsharded gradient being accumulated (compute dtype)
    pending: int = 0  # parameters whose gradient this backward has not produced yet
    gathering: Any = None  # stage 3: an all-gather in flight
    gathered: bool = True
    backward_started: bool = False
    pieces: list[tuple[int, int, int, nn.Parameter]] = field(default_factory=list)
    """(parameter group, lo, hi, the optimizer's parameter): views of `master`."""
    grad_shard: torch.Tensor | None = None  # gradient of `master`, reduced over the group

    def shard_grad(self) -> torch.Tensor:
        """The gradient shard, created (zero) on first use; the pieces' .grad view it."""
        if self.grad_shard is None:
            self.grad_shard = torch.zeros_like(self.master)
            for _, lo, hi, piece in self.pieces:
                piece.grad = self.grad_shard[lo:hi]
        return self.grad_shard

    def drop_grad_shard(self) -> None:
        self.grad_shard = None
        for *_, piece in self.pieces:
            piece.grad = None


class ZeRO(nn.Module):
    """Wrap a module and its optimizer so that state is sharded across a group.

    Args:
        module: the model; parameters and buffers are broadcast from the group's first
            rank at wrap time.
        optimizer: a factory `params -> torch.optim.Optimizer` (SGD, Adam, AdamW, ...; any
            optimizer whose state is per element, shaped like the parameter).
        stage: 1 (optimizer state), 2 (and gradients) or 3 (and parameters).
        group: the data-parallel group (e.g. `mesh.group("dp")`); default the world.
        mixed_precision: "bf16" or "fp16" to compute and communicate in that dtype while
            the optimizer updates fp32 master weights; fp16 adds dynamic loss scaling
            (call `model.backward(loss)`). None computes in the parameters' dtype.
        bucket_mb: size of a unit in stages 1 and 2 (gradients go out unit by unit).
        units: stage 3: the submodules to gather one at a time, in forward order
            (default: every element of every nn.ModuleList).
        algorithm: collective algorithm (see dtrain.comm).

    Raises:
        DtrainError: a bad stage or option, ranks with different models, or an optimizer
            factory that leaves out trainable parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        stage: int = 2,
        group: Any = None,
        mixed_precision: torch.dtype | str | None = None,
        bucket_mb: float = 25.0,
        units: list[nn.Module] | None = None,
        algorithm: str = "auto",
    ) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise DtrainError(f"ZeRO stage={stage!r}: use 1, 2 or 3")
        if bucket_mb <= 0:
            raise DtrainError(f"ZeRO bucket_mb={bucket_mb} must be positive")
        self.module, self.stage, self.algorithm = module, stage, algorithm
        self.group = comm.resolve(group)
        self.rank, self.size = self.group.rank, self.group.size
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise DtrainError("ZeRO: the module has no trainable parameters")
        if self.size > 1:
            check_same_model([p for _, p in named], self.group, "ZeRO", algorithm)
            broadcast_state(module, self.group, algorithm)
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise DtrainError(f"ZeRO: parameters of several dtypes {sorted(map(str, dtypes))}; "
                              "cast the model to one dtype")
        self.param_dtype = dtypes.pop()
        self.compute_dtype = parse_dtype(mixed_precision) or self.param_dtype
        self.mixed = self.compute_dtype != self.param_dtype
        self._scale = 2.0**16 if self.compute_dtype == torch.float16 else 1.0
        self._good_steps = 0
        self._overflow: bool | None = None

        template = optimizer([p for _, p in named])
        self._group_of = _group_index(template, named)
        name_of = {id(p): n for n, p in named}
        self.layout = [[name_of[id(p)] for p in g["params"]] for g in template.param_groups]
        self.shapes = {n: p.shape for n, p in named}
        # state_dict key -> the trainable parameter it holds (tied weights: several keys)
        self.alias = {key: name_of[id(p)] for key, p in
                      module.named_parameters(remove_duplicate=False) if id(p) in name_of}
        self._units = self._build_units(named, stage, units, bucket_mb)
        self.optimizer = _shard_optimizer(template, self._units, self.rank)
        self._sync = True
        self._finalize_queued = False
        self._next_launch = 0
        self._works: list[tuple[_Unit, Any]] = []
        self._hooks = [module.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        for unit in self._units:
            for i, p in enumerate(unit.flat.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._grad_hook(unit, unit.flat.offsets[i])))
        if stage == 3:
            for k, unit in enumerate(self._chain):
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda m, args, k=k: self._gather_for_forward(k)))
                self._hooks.append(unit.module.register_forward_hook(
                    lambda m, args, out, k=k: self._after_forward(k, out)))
            self._hooks.append(module.register_forward_hook(self._after_root_forward))
            for unit in self._units:
                self._free(unit)

    # ----------------------------------------------------------------- set-up
    def _build_units(self, named: list[tuple[str, nn.Parameter]], stage: int,
                     units: list[nn.Module] | None, bucket_mb: float) -> list[_Unit]:
        """Units in the order their gradients go out (the reverse of forward)."""
        if stage == 3:
            runs = self._module_runs(named, units)
        else:
            runs = [(run, None) for run in
                    split_by_size(list(reversed(named)), int(bucket_mb * 2**20))]
        built = []
        for run, unit_module in runs:
            if not run:
                built.append(None)
                continue
            run = sorted(run, key=lambda item: self._group_of[id(item[1])])
            flat = FlatUnit([n for n, _ in run], [p for _, p in run],
                            [self._group_of[id(p)] for _, p in run], self.size)
            built.append(self._make_unit(flat, unit_module))
        self._root: _Unit | None = built[0] if stage == 3 else None
        self._chain: list[_Unit] = built[1:] if stage == 3 else []  # forward order
        return [u for u in reversed(built) if u is not None] if stage == 3 else built

    def _module_runs(self, named: list[tuple[str, nn.Parameter]],
                     units: list[nn.Module] | None):
        """Stage 3: (parameters, module) per unit, the root (what no unit claims, maybe
        nothing) first, then the units in forward order."""
        if units is None:
            units = [m for lst in self.module.modules() if isinstance(lst, nn.ModuleList)
                     for m in lst]
        owner: dict[int, int] = {}
        for k, m in enumerate(units):
            for p in m.parameters():
                if id(p) in owner and owner[id(p)] != k:
                    raise DtrainError("ZeRO stage 3: a parameter is shared by two units; "
                                      "make them one unit")
                owner[id(p)] = k
        runs = [([(n, p) for n, p in named if id(p) not in owner], self.module)]
        for k, m in enumerate(units):
            run = [(n, p) for n, p in named if owner.get(id(p)) == k]
            if run:
                runs.append((run, m))
        return runs

    @torch.no_grad()
    def _make_unit(self, flat: FlatUnit, module: nn.Module | None) -> _Unit:
        values = torch.zeros(flat.padded, dtype=self.param_dtype, device=flat.params[0].device)
        for p, offset in zip(flat.params, flat.offsets, strict=True):
            values[offset : offset + p.numel()] = p.detach().reshape(-1)
        lo, hi = flat.shard(self.rank)
        full = values if not self.mixed else values.to(self.compute_dtype)
        master = values[lo:hi] if not self.mixed and self.stage < 3 else values[lo:hi].clone()
        for p, offset in zip(flat.params, flat.offsets, strict=True):
            p.data = full[offset : offset + p.numel()].view(p.shape)
        unit = _Unit(flat, full, master, module)
        if self.stage == 1:
            unit.grad = torch.zeros_like(full)
        return unit

    # ----------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        for unit in self._units:
            unit.pending = len(unit.flat.params)
            unit.backward_started = False
        if self._root is not None:
            self._gather(self._root)
        if self._chain:
            self._start_gather(self._chain[0])
        if self.mixed:
            cast = lambda t: t.to(self.compute_dtype) if (  # noqa: E731
                isinstance(t, torch.Tensor) and t.is_floating_point()) else t
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _gather_for_forward(self, k: int) -> None:
        self._gather(self._chain[k])
        if k + 1 < len(self._chain):
            self._start_gather(self._chain[k + 1])  # prefetch while this one computes

    def _after_forward(self, k: int, output: Any) -> None:
        unit = self._chain[k]
        self._free(unit)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, k=k: self._before_backward(k))

    def _after_root_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows
            for unit in self._units:
                self._free(unit)
        elif self._root is not None:  # gathered again for this output's backward, which may
            for t in tree_flatten(output)[0]:  # come after other forwards (a pipeline)
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self._gather(self._root))

    def _before_backward(self, k: int) -> None:
        unit = self._chain[k]
        if unit.backward_started:
            return
        unit.backward_started = True
        self._gather(unit)
        if k > 0:  # prefetch the unit whose backward comes next
            self._start_gather(self._chain[k - 1])

    # ----------------------------------------------------------------- stage 3 gathers
    def _start_gather(self, unit: _Unit) -> None:
        if unit.gathered or unit.gathering is not None:
            return
        source = unit.master.to(self.compute_dtype) if self.mixed else unit.master
        unit.gathering = comm.all_gather(source, group=self.group, async_op=True,
                                         algorithm=self.algorithm)

    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        if unit.gathered:
            return
        self._start_gather(unit)
        gathered = unit.gathering.wait()
        unit.gathering = None
        storage = unit.full.untyped_storage()
        storage.resize_(unit.flat.padded * unit.full.element_size())
        unit.full.copy_(gathered)
        unit.gathered = True

    def _free(self, unit: _Unit) -> None:
        if self.stage == 3 and unit.gathered:
            unit.full.untyped_storage().resize_(0)
            unit.gathered = False

    # ----------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled under fp16 mixed precision."""
        (loss * self._scale if self._scale != 1.0 else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally, without communication, inside this
        context; the first backward outside it reduces everything accumulated so far."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_hook(self, unit: _Unit, offset: int):
        def hook(param: torch.Tensor) -> None:
            with torch.no_grad():
                if unit.grad is None:
                    unit.grad = torch.zeros_like(unit.full)
                unit.grad[offset : offset + param.numel()].add_(param.grad.reshape(-1))
                param.grad = None
            if not self._finalize_queued:
                self._finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            unit.pending -= 1
            if unit.pending == 0:
                if unit is not self._root:  # the root's parameters serve till backward ends
                    self._free(unit)
                if self._sync:
                    self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        # Units go out strictly in order, so every rank issues the same collectives.
        while self._next_launch < len(self._units):
            unit = self._units[self._next_launch]
            if unit.pending:
                return
            self._launch(unit)

    def _launch(self, unit: _Unit) -> None:
        work = comm.reduce_scatter(unit.grad, op="avg", group=self.group, async_op=True,
                                   algorithm=self.algorithm)
        self._works.append((unit, work))
        if self.stage >= 2:
            unit.grad = None  # released once the collective has read it
        self._next_launch += 1

    @torch.no_grad()
    def _finalize(self) -> None:
        """At the end of backward: send what is left, wait, keep each rank's shard."""
        self._finalize_queued = False
        for unit in self._units:  # ready for the next backward, with or without a forward
            self._free(unit)
            unit.pending = len(unit.flat.params)
            unit.backward_started = False
        if self._sync:
            self.reduce_gradients()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter what backward has not sent yet (everything accumulated under
        `no_sync`) and keep this rank's shard: what the first backward outside `no_sync`
        does at its end. For callers that adjust accumulated gradients first (a pipeline
        summing a tied weight's gradient across stages, via `accumulated_grad`)."""
        for unit in self._units[self._next_launch :]:
            if unit.grad is None:
                unit.grad = torch.zeros_like(unit.full)
            self._launch(unit)
        for unit, work in self._works:
            unit.shard_grad().add_(work.wait())
            if unit.grad is not None:  # stage 1 keeps its buffer for the next step
                unit.grad.zero_()
        self._works.clear()
        self._next_launch = 0
        self._overflow = None

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The unsharded gradient of `param` accumulated under `no_sync` (a view; zeros if
        backward has not reached it)."""
        for unit in self._units:
            for p, offset in zip(unit.flat.params, unit.flat.offsets, strict=True):
                if p is param:
                    if unit.grad is None:
                        unit.grad = torch.zeros_like(unit.full)
                    return unit.grad[offset : offset + p.numel()].view(p.shape)
        raise DtrainError("ZeRO.accumulated_grad: the parameter is not one of this module's")

    # ----------------------------------------------------------------- step
    def _has_overflow(self) -> bool:
        """fp16: whether any rank's gradients hold inf or nan (then the step is skipped)."""
        if self._scale == 1.0:
            return False
        if self._overflow is None:
            bad = any(not torch.isfinite(u.shard_grad()).all() for u in self._units)
            flag = torch.tensor([float(bad)])
            self._overflow = comm.all_reduce(flag, op="max", group=self.group,
                                             algorithm=self.algorithm).item() > 0
            if not self._overflow:
                for unit in self._units:
                    unit.shard_grad().mul_(1.0 / self._scale)
        return self._overflow

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm
        before clipping (as torch.nn.utils.clip_grad_norm_ on the unsharded gradients)."""
        if self._has_overflow():
            return torch.tensor(float("inf"))
        local = sum(u.shard_grad().double().pow(2).sum() for u in self._units)
        total = comm.all_reduce(local.view(1), group=self.group,
                                algorithm=self.algorithm).sqrt()[0].float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for unit in self._units:
            unit.shard_grad().mul_(coef.to(unit.master.dtype))
        return total

    @torch.no_grad()
    def step(self) -> bool:
        """Update this rank's shards, then (stages 1 and 2) all-gather the parameters.
        Returns False when fp16 overflow skipped the step (the loss scale halves)."""
        if self._has_overflow():
            self._scale /= 2
            self._good_steps = 0
            return False
        self.optimizer.step()
        if self._scale != 1.0:
            self._good_steps += 1
            if self._good_steps % GROWTH_INTERVAL == 0:
                self._scale *= 2
        self.refresh_parameters()
        return True

    @torch.no_grad()
    def refresh_parameters(self) -> None:
        """Rebuild the full parameters from every rank's master shard (stages 1 and 2;
        stage 3 gathers at the next forward)."""
        if self.stage == 3:
            return
        works = []
        for unit in self._units:
            shard = unit.full[slice(*unit.flat.shard(self.rank))]
            if self.mixed:
                shard.copy_(unit.master)
            works.append(comm.all_gather(shard, group=self.group, async_op=True,
                                         algorithm=self.algorithm))
        for unit, work in zip(self._units, works, strict=True):
            unit.full.copy_(work.wait())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the last step (and any accumulated under no_sync);
        `set_to_none` also releases the gradient shards until the next backward."""
        for unit in self._units:
            if set_to_none:
                unit.drop_grad_shard()
            elif unit.grad_shard is not None:
                unit.grad_shard.zero_()
            if unit.grad is not None:
                if self.stage == 1:
                    unit.grad.zero_()
                else:
                    unit.grad = None
        self._overflow = None

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scale = float(value)

    # ----------------------------------------------------------------- state
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The full (unsharded) state_dict of the wrapped module, in the parameters' own
        dtype, keys without a wrapper prefix. Collective: call it on every rank."""
        return zero_state.full_state(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,
                        assign: bool = False):
        """Load a full state_dict (as `state_dict` returns or the unwrapped module's);
        each rank keeps its shard. Collective."""
        trainable = {self.alias[k]: v for k, v in state_dict.items() if k in self.alias}
        missing = sorted(set(self.alias.values()) - set(trainable))
        if strict and missing:
            raise DtrainError(f"ZeRO.load_state_dict: missing {', '.join(missing[:3])}")
        rest = {k: v for k, v in state_dict.items() if k not in self.alias}
        own = {k for k in self.module.state_dict() if k not in self.alias}
        if strict and own - set(rest):
            raise DtrainError(f"ZeRO.load_state_dict: missing {', '.join(sorted(own - set(rest)))}")
        with torch.no_grad():
            module_state = self.module.state_dict(keep_vars=True)
            for key, value in rest.items():
                if key in module_state:
                    module_state[key].copy_(value)
        zero_state.load_segments(self, zero_state.whole(trainable, list(self.shapes)),
                                 None, None, None)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The full optimizer state_dict, as the optimizer built by the factory on the
        unwrapped module would return it. Collective."""
        return zero_state.full_optimizer_state(self)

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state_dict (as `optimizer_state_dict` returns)."""
        names = [n for group in self.layout for n in group]
        per_key: dict[str, dict[str, torch.Tensor]] = {}
        scalars: list[dict[str, torch.Tensor]] = [{} for _ in self.layout]
        for k, group in enumerate(state_dict["param_groups"]):
            for index in group["params"]:
                for key, value in state_dict["state"].get(index, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        per_key.setdefault(key, {})[names[index]] = value
                    else:
                        scalars[k].setdefault(key, torch.as_tensor(value))
        state = {key: zero_state.whole(values, names) for key, values in per_key.items()}
        options = [{key: v for key, v in g.items() if key != "params"}
                   for g in state_dict["param_groups"]]
        masters = zero_state.master_segments(self)  # kept as they are
        zero_state.load_segments(self, masters, state, scalars, options)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the master weights and optimizer state, described per
        parameter so that a run of any size can load them (`load_sharded_state_dict`)."""
        return zero_state.sharded_state(self)

    def load_sharded_state_dict(self, shards: list[dict[str, Any]]) -> None:
        """Load the `sharded_state_dict()` of every rank of a run, whatever its size."""
        zero_state.load_sharded_state(self, shards)

    # ----------------------------------------------------------------- introspection
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds now: parameters (the module's, as
        materialized, plus separate master shards), gradients and optimizer state."""
        params = sum(u.full.untyped_storage().nbytes() for u in self._units)
        masters = sum(u.master.numel() * u.master.element_size() for u in self._units
                      if u.master.untyped_storage().data_ptr()
                      != u.full.untyped_storage().data_ptr())
        grads = sum((u.grad_shard.numel() * u.grad_shard.element_size()
                     if u.grad_shard is not None else 0)
                    + (u.grad.numel() * u.grad.element_size() if u.grad is not None else 0)
                    for u in self._units)
        optim = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                    for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"params": params, "master": masters, "grads": grads, "optimizer": optim}

    @property
    def units(self) -> list[FlatUnit]:
        """The flat units, in the order their gradients are reduced."""
        return [u.flat for u in self._units]


def _group_index(template: torch.optim.Optimizer,
                 named: list[tuple[str, nn.Parameter]]) -> dict[int, int]:
    group_of = {id(p): k for k, g in enumerate(template.param_groups) for p in g["params"]}
    left_out = [n for n, p in named if id(p) not in group_of]
    if left_out:
        raise DtrainError(f"ZeRO: the optimizer factory left out trainable parameters "
                          f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''}); "
                          "set requires_grad=False on parameters that should not train")
    return group_of


def _shard_optimizer(template: torch.optim.Optimizer, units: list[_Unit], rank: int
                     ) -> torch.optim.Optimizer:
    """The template's class and options over this rank's pieces of each parameter group."""
    pieces: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
    for unit in units:
        for group, lo, hi in unit.flat.pieces(rank):
            piece = nn.Parameter(unit.master[lo:hi])
            pieces[group].append(piece)
            unit.pieces.append((group, lo, hi, piece))
    groups = []
    for k, options in enumerate(template.param_groups):
        params = pieces[k] or [_empty_piece(units[0].master)]  # keep groups aligned
        groups.append({**{key: v for key, v in options.items() if key != "params"},
                       "params": params})
    accepted = inspect.signature(type(template)).parameters  # defaults may hold more
    return type(template)(groups, **{k: v for k, v in template.defaults.items()
                                     if k in accepted})


def _empty_piece(like: torch.Tensor) -> nn.Parameter:
    piece = nn.Parameter(like.new_zeros(0))
    piece.grad = like.new_zeros(0)
    return piece
