"""The ZeRO module (dtrain.data_parallel.zero describes the stages and what each rank keeps).

One class, because its forward and backward hooks, its step, its clip and its averaging
over live replicas all work on the same units: the hooks gather, free and reduce-scatter the
flat units, the step updates this rank's shards, and the clip takes the global norm over
them. What stands apart is in modules of its own: the units' tensors and their packing
(.units), the optimizer rebuilt over this rank's shards (.optimizer), and the state in
and out, full and sharded (.state_io).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dtrain import comm, timeline
from dtrain.comm.collectives import Result
from dtrain.comm.group import Handle
from dtrain.comm.quantized import DEFAULT_BLOCK
from dtrain.data_parallel import clip, late_grads
from dtrain.data_parallel.agreement import (
    agreement_device,
    broadcast_state,
    broadcast_tensors,
    check_same_model,
)
from dtrain.data_parallel.averaging import Averaging, Carried
from dtrain.data_parallel.buckets import launch_ready
from dtrain.data_parallel.clip import GradPart
from dtrain.data_parallel.wrapper import agreeing_algorithm, parse_dtype
from dtrain.data_parallel.zero import state_io as zero_state
from dtrain.data_parallel.zero.offload import Offload
from dtrain.data_parallel.zero.optimizer import OptimizerFactory, group_index, shard_optimizer
from dtrain.data_parallel.zero.optimizer import state_bytes as optimizer_bytes
from dtrain.data_parallel.zero.units import (
    IN_FLIGHT,
    Reducing,
    Sharding,
    Unit,
    Wires,
    add_reduced,
    build_units,
    one_dtype,
    segment,
    settle,
    unit_bytes,
)
from dtrain.errors import DtrainError
from dtrain.models.compiled import gradients_together
from dtrain.models.moe import split_experts

GROWTH_INTERVAL = 2000  # fp16: steps without overflow before the loss scale doubles
ParamTest = Callable[[nn.Parameter], bool]


class ZeRO(nn.Module):
    """Wrap a module and its optimizer so that state is sharded across a group.

    Args:
        module: the model; parameters and buffers are broadcast from the group's first
            rank at wrap time.
        optimizer: a factory `params -> torch.optim.Optimizer` (SGD, Adam, AdamW, ...; any
            optimizer whose state is per element, shaped like the parameter).
        stage: 1 (optimizer state), 2 (and gradients) or 3 (and parameters).
        group: the data-parallel group (e.g. `mesh.group("dp")`); default the world.
            Under hybrid sharding, the ranks of one replica (`mesh.group("dp_shard", "cp")`).
        mixed_precision: "bf16" or "fp16" to compute and communicate in that dtype while
            the optimizer updates fp32 master weights; fp16 adds dynamic loss scaling
            (call `model.backward(loss)`). None computes in the parameters' dtype.
        bucket_mb: size of a unit in stages 1 and 2 (gradients go out unit by unit).
        units: stage 3: the submodules to gather one at a time, in forward order
            (default: every element of every nn.ModuleList).
        algorithm: collective algorithm (see dtrain.comm); the wrap's own checks and
            broadcasts take it where it is "auto" or "native", else "native".
        device: where the units of a module built on the meta device are allocated
            (dtrain.models.init; each rank allocates its shards only, values to be
            restored, e.g. by dtrain.layouts); default the CPU.
        averaging: when the group is one of several live replicas that change from step to
            step (dtrain.data_parallel.averaging; fault tolerance, dtrain.ft, hands one):
            after the reduce-scatter inside the group, each rank's gradient shard
            is averaged by it with the same shard of the other live replicas (a step it does not
            count leaves the group's own average).
        expert_group: under expert parallelism, the ranks of `group` that hold the same
            experts as this one (`mesh.group("edp")`): the experts each rank holds of the
            model's MoE layers (dtrain.models.moe.split_experts) are sharded over it, in
            units of their own, their gradients summed over it and divided by the size of
            `group` (each expert's gradient already sums the tokens its expert-parallel
            peers sent it); the rest as always. With `averaging`, each shard is then
            averaged with the same shard of the other live replicas, which split their experts
            alike.
        offload_device: "cpu" to keep the optimizer state (and the fp32 master shards of
            mixed precision) in host memory and step the optimizer there, each unit's
            gradient shard copied to the host and its parameters back in the background
            (dtrain.data_parallel.zero.offload); None (default) keeps them on the module's
            device.
        replicate_group: hybrid sharding (HSDP): the ranks that hold the same shards in
            the other replicas (`mesh.group("dp_replicate")`): each unit's reduced gradient
            shard is averaged over them as soon as its reduce-scatter inside `group` is
            done (an all-reduce of 1/N of the unit: the only traffic across replicas), so
            every replica steps the same shards. None (default): `group` is every rank
            holding the model.
        gather_dtype: the dtype the weights' all-gathers travel in (ZeRO++'s qwZ): "bf16",
            "fp8" or "int8" (blockwise scales of `quant_block` elements; dtrain.comm.quantized),
            every rank dequantizing every shard, its own too (the master shards stay
            exact); None: the compute dtype.
        reduce_dtype: the dtype the gradients' reduce-scatters travel in (qgZ): "fp32",
            "bf16" or "int8" (each destination's chunk quantized, exchanged by all-to-all,
            summed in fp32); one narrower than the compute dtype keeps what it dropped and
            adds it to the next step's gradient (error feedback). None: the compute dtype.
        frozen: parameters that do not train (requires_grad False) to shard too at stage 3
            (a LoRA run's base): each rank keeps its shard, gathered with its module for
            forward and backward and freed after, with no gradient buffer or optimizer
            state; stages 1-2 leave them whole, as any frozen parameter not given here.

    Raises:
        DtrainError: a bad stage or option, ranks with different models, or an optimizer
            factory that leaves out trainable parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        stage: int = 2,
        group: comm.GroupLike = None,
        mixed_precision: torch.dtype | str | None = None,
        bucket_mb: float = 25.0,
        units: list[nn.Module] | None = None,
        algorithm: str = "auto",
        device: torch.device | str | None = None,
        averaging: Averaging | None = None,
        expert_group: comm.GroupLike = None,
        offload_device: torch.device | str | None = None,
        frozen: Sequence[nn.Parameter] = (),
        replicate_group: comm.GroupLike = None,
        gather_dtype: str | None = None,
        reduce_dtype: str | None = None,
        quant_block: int = DEFAULT_BLOCK,
    ) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise DtrainError(f"ZeRO stage={stage!r}: use 1, 2 or 3")
        experts = split_experts(module)
        if experts and expert_group is None:
            raise DtrainError("ZeRO of a model whose experts are split (expert parallelism) "
                              "needs expert_group= (mesh.group(\"edp\"))")
        if bucket_mb <= 0:
            raise DtrainError(f"ZeRO bucket_mb={bucket_mb} must be positive")
        self.module = module
        self.stage = stage
        self.algorithm = algorithm
        self.group = comm.resolve(group)
        self.rank = self.group.rank
        self.size = self.group.size
        replicas = None if replicate_group is None else comm.resolve(replicate_group)
        self.replicate = replicas if replicas is not None and replicas.size > 1 else None
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise DtrainError("ZeRO: the module has no trainable parameters")
        apart = frozenset(id(p) for p in experts)
        sharding = Sharding(self.group)
        if experts:
            expert_ranks = comm.resolve(expert_group)
            sharding = Sharding(self.group, apart, expert_ranks,
                                expert_ranks.size / self.size)
        agreeing = agreeing_algorithm(algorithm)
        for over in (self.replicate, self.group):  # the replicas first, then inside one
            if over is None or over.size == 1:
                continue
            check_same_model([p for _, p in named], over, "ZeRO", agreeing)
            broadcast_state(module, over, agreeing, skip=apart)
            if experts and over is self.replicate:
                broadcast_tensors(experts, over, agreeing)
        if experts and expert_ranks.size > 1:  # the sharding's apart_group
            broadcast_tensors(experts, expert_ranks, agreeing)
        self.param_dtype = one_dtype(named)
        self.compute_dtype = parse_dtype(mixed_precision) or self.param_dtype
        self.mixed = self.compute_dtype != self.param_dtype
        self._scale = 2.0**16 if self.compute_dtype == torch.float16 else 1.0
        self._good_steps = 0
        self._overflow: bool | None = None

        template = optimizer([p for _, p in named])
        group_of = group_index(template, named)
        name_of = {id(p): n for n, p in named}
        self.layout = [[name_of[id(p)] for p in g["params"]] for g in template.param_groups]
        self.shapes = {n: p.shape for n, p in named}
        # state_dict key -> the trainable parameter it holds (tied weights: several keys)
        self.alias = {key: name_of[id(p)] for key, p in
                      module.named_parameters(remove_duplicate=False) if id(p) in name_of}
        # stage 3 shards `frozen` too (a LoRA run's base): gathered and freed with the
        # trainable parameters, never reduced or stepped; stages 1-2 leave them whole
        kept = {id(p) for p in frozen if not p.requires_grad} if stage == 3 else set()
        still = [(n, p) for n, p in module.named_parameters() if id(p) in kept]
        wires = Wires(gather_dtype, reduce_dtype, quant_block)
        built = build_units(module, named, group_of, stage, units, bucket_mb, sharding,
                            self.param_dtype, self.compute_dtype,
                            torch.device(device) if device is not None else None, still,
                            wires)
        self.units: list[Unit] = built.units  # in the order their gradients are reduced
        self.frozen: list[Unit] = built.frozen  # stage 3: the frozen parameters' units
        frozen_name = {id(p): n for n, p in still}
        self.frozen_alias = {key: frozen_name[id(p)] for key, p in
                             module.named_parameters(remove_duplicate=False)
                             if id(p) in frozen_name}
        self._held = [*self.units, *self.frozen]  # every unit a forward gathers
        self._root = built.root  # stage 3: what no unit claims, held from forward to backward
        self._chain = built.chain  # stage 3: each module's units, in forward order
        self.offload = None if offload_device is None else \
            Offload(self.units, stage, torch.device(offload_device))  # before the optimizer
        self._place = {unit: k for k, units_of in enumerate(self._chain) for unit in units_of}
        self._compiled = _compiled_units(module, self._chain, self.frozen)
        self.optimizer = shard_optimizer(template, self.units)
        self.averaging = averaging
        if averaging is not None:
            self._scaler = torch.zeros(2, dtype=torch.float64)  # what a replacement is sent
            averaging.attach(Carried(self._carried, self._trained, self._carried_in),
                             self.optimizer)
        self._sync = True
        self._finalize_queued = False
        self._next_launch = 0
        self._works: list[Reducing] = []  # reduce-scatters in flight, oldest first
        # HSDP: reduced shards being averaged across the replicas, oldest first
        self._crossing: list[tuple[Unit, Result[torch.Tensor]]] = []
        self._late: list[tuple[Unit, int, torch.Tensor, late_grads.Finisher]] = []
        self._hooks = [module.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        for unit in self.units:
            for i, p in enumerate(unit.flat.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._grad_hook(unit, unit.flat.offsets[i])))
        if stage == 3:
            for k, (unit, *_) in enumerate(self._chain):
                assert unit.module is not None  # stage 3: each unit's submodule
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda m, args, kwargs, k=k: self._gather_for_forward(k, args, kwargs),
                    with_kwargs=True))
                self._hooks.append(unit.module.register_forward_hook(
                    lambda m, args, out, k=k: self._after_forward(k, out)))
            self._hooks.append(module.register_forward_hook(self._after_root_forward))
            self._free(self._held)

    # ----------------------------------------------------------------- live replicas
    def _carried(self) -> list[torch.Tensor]:
        """The state a joining live replica is sent, beside the optimizer's: this rank's
        master shards (the parameters are rebuilt from them; at stage 3 they are all
        there is), the frozen parameters' shards, the buffers, and the loss scaler's
        state (the scale and its count of good steps, in `_scaler`)."""
        self._scaler[0], self._scaler[1] = self._scale, self._good_steps
        return [*self._trained(), *(u.master for u in self.frozen),
                *(b.data for b in self.module.buffers()), self._scaler]

    def _trained(self) -> list[torch.Tensor]:
        return [unit.master for unit in self.units]

    def _carried_in(self) -> None:
        """A joining live replica's tensors are in: the parameters rebuilt from the
        masters, the loss scaler's state taken back."""
        self._scale, self._good_steps = float(self._scaler[0]), int(self._scaler[1])
        self.publish_masters()

    # ----------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        for unit in self._held:
            unit.reset_backward()
        self._gather(self._root)
        if self._chain:
            self._start_gather(self._chain[0])
        if self.mixed:
            cast = lambda t: t.to(self.compute_dtype) if (  # noqa: E731
                isinstance(t, torch.Tensor) and t.is_floating_point()) else t
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _gather_for_forward(self, k: int, args: tuple, kwargs: dict) -> None:
        self._gather(self._chain[k])
        if k + 1 < len(self._chain):
            self._start_gather(self._chain[k + 1])  # prefetch while this one computes
        frozen = [unit for unit in self._chain[k] if unit in self.frozen]
        if frozen and torch.is_grad_enabled():
            # frozen units have no gradient to tell when their module's backward is done:
            # the gradients of its inputs do (else they go at the end of backward)
            inputs = [t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            left = [len(inputs)]

            def done(grad: torch.Tensor) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self._free(frozen)

            for t in inputs:
                t.register_hook(done)

    def _after_forward(self, k: int, output: object) -> None:
        self._free(self._chain[k])
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, k=k: self._before_backward(k))

    def _after_root_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.is_grad_enabled():  # no backward follows
            self._free(self._held)
        elif self._root:
            # The root is gathered again for this output's backward, which may come after
            # other forwards (a pipeline).
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self._gather(self._root))

    def _before_backward(self, k: int) -> None:
        units = self._chain[k]
        if units[0].backward_started:
            return
        for unit in units:
            unit.backward_started = True
        with timeline.span("gather for backward", "sync"):  # from when the block needs them
            self._gather(units)  # the prefetch of the unit before waits for its first gradient
        if k in self._compiled and k > 0:  # ... which a compiled block makes at its end
            self._start_gather(self._chain[k - 1])

    def _prefetch_before(self, unit: Unit) -> None:
        """Stage 3, at `unit`'s first gradient: start gathering the units whose backward
        comes next. Not earlier: while `unit`'s forward is recomputed, the reduce-scatter
        of the unit after it is still in flight (`_grad_hook`), and a prefetch then would
        hold a third whole unit beside the two. A compiled block's first gradient is its
        last (its backward is one graph: dtrain.models.compiled), so a prefetch then
        would have nothing left to hide behind: the unit before a compiled one is
        prefetched as its backward starts (`_before_backward`), as FSDP's BACKWARD_PRE
        does, holding that third unit while the reduce-scatter is in flight."""
        k = self._place.get(unit)
        if k is not None and k > 0:
            self._start_gather(self._chain[k - 1])

    # ----------------------------------------------------------------- stage 3 gathers
    def _start_gather(self, units: list[Unit]) -> None:
        for unit in units:
            unit.start_gather(self.algorithm)

    def _gather(self, units: list[Unit]) -> None:
        self._start_gather(units)  # each group's gather in flight before waiting for any
        for unit in units:
            unit.gather(self.algorithm)

    def _free(self, units: list[Unit]) -> None:
        if self.stage == 3:
            for unit in units:
                unit.free()

    # ----------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled under fp16 mixed precision."""
        (loss * self._scale if self._scale != 1.0 else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally, without communication, inside this
        context; the first backward outside it reduces everything accumulated so far."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_hook(self, unit: Unit, offset: int):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # no gradient this time (a split backward's B: its W
                return  # brings it, dtrain.pipeline.split_backward)
            if not self._finalize_queued:
                self._finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            finisher = late_grads.late(param)
            if finisher is not None:  # summed over tp at the end of backward: read it then
                self._late.append((unit, offset, param, finisher))
                return
            self._take(unit, offset, param)

        return hook

    def _take(self, unit: Unit, offset: int, param: torch.Tensor) -> None:
        """Take `param`'s gradient into its unit's (stages 1-2: at once; stage 3: when the
        unit's last one has come); launch the units complete."""
        with torch.no_grad():
            if self.stage < 3:
                assert param.grad is not None  # taken from its accumulate-grad hook
                unit.grad_buffer()[offset : offset + param.numel()].add_(
                    param.grad.reshape(-1))
                param.grad = None
            elif unit.pending == len(unit.flat.params):
                # Stage 3, the unit's first gradient: the reduce-scatter in flight (the
                # unit before, in backward's order) is waited for, its buffer released,
                # while this unit's gradients are still few. They stay autograd's own
                # until the last, packed then into the unit's buffer (`Unit.pack_grads`):
                # its backward holds them as they come, not a whole buffer from the first.
                self._settle(0)
                self._prefetch_before(unit)
        unit.pending -= 1
        if unit.pending == 0:
            if unit not in self._root:  # the root's parameters serve till backward ends
                self._free([unit])
            if self.stage == 3:
                unit.pack_grads()
            if self._sync:
                self._launch_ready()

    def _take_late(self) -> None:
        """The gradients finished at the end of backward (dtrain.data_parallel.late_grads)."""
        late, self._late = self._late, []
        for *_, finisher in late:
            finisher.finish()
        for unit, offset, param, _ in late:
            self._take(unit, offset, param)

    def _launch_ready(self) -> None:
        self._next_launch = launch_ready(self.units, self._next_launch, self._launch)

    def _launch(self, unit: Unit) -> None:
        grad = unit.grad
        assert grad is not None  # launched once its gradients are all in
        self._works.append(Reducing(unit, unit.reduce_scatter(grad, self.algorithm), grad))
        if self.stage >= 2:
            unit.grad = None  # released once the collective is waited for (`settle`)
        self._settle(IN_FLIGHT if self.stage < 3 else 1)

    def _settle(self, keep: int) -> None:
        """Wait for all but `keep` of the reduce-scatters in flight (`settle`); under
        hybrid sharding each one's shard then goes on across the replicas."""
        settle(self._works, keep, self._arrive if self.replicate is not None else add_reduced)

    def _arrive(self, unit: Unit, reduced: torch.Tensor) -> None:
        """HSDP: start averaging a unit's reduced shard with the same shard of the other
        replicas; at most `IN_FLIGHT` at a time, added to the shard gradient as each ends."""
        self._crossing.append((unit, comm.all_reduce(reduced, op="avg", group=self.replicate,
                                                     async_op=True, algorithm=self.algorithm)))
        self._cross(IN_FLIGHT)

    def _cross(self, keep: int) -> None:
        while len(self._crossing) > keep:
            unit, work = self._crossing.pop(0)
            add_reduced(unit, work.wait())

    @torch.no_grad()
    def _finalize(self) -> None:
        """At the end of backward: send what is left, wait, keep each rank's shard (a
        timeline span "finish backward" from the end of backward's compute)."""
        with timeline.span("finish backward", "sync"):
            self._finish()

    def _finish(self) -> None:
        self._finalize_queued = False
        self._take_late()
        self._free(self._held)  # ready for the next backward, with or without a forward
        if self.stage == 3:  # units some of whose parameters got no gradient
            for unit in self.units:
                unit.pack_grads()
        for unit in self._held:
            unit.reset_backward()
        if self._sync:
            self.reduce_gradients()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter what backward has not sent yet (everything accumulated under
        `no_sync`) and keep this rank's shard: what the first backward outside `no_sync`
        does at its end. For callers that adjust accumulated gradients first (a pipeline
        summing a tied weight's gradient across stages, via `accumulated_grad`)."""
        for unit in self.units[self._next_launch :]:
            unit.grad_buffer()
            self._launch(unit)
        self._settle(0)
        self._cross(0)
        self._next_launch = 0
        self._overflow = None
        if self.averaging is not None:  # then each shard over the other live replicas
            shards = [unit.shard_grad() for unit in self.units]
            members = self.averaging.finish([self.averaging.start(t) for t in shards], shards)
            if members:  # 0: the step does not count here, the shards keep the group's
                for shard in shards:
                    shard.div_(members)

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The unsharded gradient of `param` accumulated under `no_sync` (a view; zeros if
        backward has not reached it)."""
        for unit in self.units:
            grad = unit.param_grad(param)
            if grad is not None:
                return grad
        raise DtrainError("ZeRO.accumulated_grad: the parameter is not one of this module's")

    # ----------------------------------------------------------------- step
    def _has_overflow(self) -> bool:
        """fp16: whether any rank's gradients hold inf or nan (then the step is skipped)."""
        if self._scale == 1.0:
            return False
        if self._overflow is None:
            bad = any(not torch.isfinite(u.shard_grad()).all() for u in self.units)
            flag = torch.tensor([float(bad)],
                                device=agreement_device([u.shard_grad() for u in self.units]))
            self._overflow = comm.all_reduce(flag, op="max", group=self.group,
                                             algorithm=self.algorithm).item() > 0
            if not self._overflow:
                for unit in self.units:
                    unit.shard_grad().mul_(1.0 / self._scale)
        return self._overflow

    def grad_parts(self, is_split: ParamTest | None = None,
                   counted: ParamTest | None = None) -> list[GradPart]:
        """This rank's reduced gradient shards as parts of a global norm (see
        dtrain.data_parallel.clip), summed over "dp", and over "tp" too where `is_split(param)`
        (a tensor-parallel block); `counted(param)` False marks a copy another rank counts
        (a tied weight's second holder). One part per unit without predicates, else one per
        parameter range. Under fp16 the shards are unscaled first (collective over the
        group, once per backward); after an overflow they hold inf or nan."""
        self._has_overflow()
        parts = []
        for unit in self.units:
            if is_split is None and counted is None:
                parts.append(GradPart(unit.shard_grad(), over=("dp",)))
                continue
            for span, param in unit.shard_spans():
                split = is_split is not None and is_split(param)
                parts.append(GradPart(segment(unit.shard_grad(), span),
                                      over=("dp", "tp") if split else ("dp",),
                                      counted=counted is None or counted(param)))
        return parts

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm
        before clipping (as torch.nn.utils.clip_grad_norm_ on the unsharded gradients), or
        inf when fp16 gradients overflowed (the step will be skipped)."""
        if self._has_overflow():
            return torch.tensor(float("inf"))
        norm = clip.clip_grad_norm_(self.grad_parts(), max_norm, groups={"dp": self.group})
        return torch.tensor(norm, dtype=torch.float32, device=self.units[0].master.device)

    @torch.no_grad()
    def step(self) -> bool:
        """Update this rank's shards, then (stages 1 and 2) all-gather the parameters.
        Returns False when fp16 overflow skipped the step (the loss scale halves)."""
        if self._has_overflow():
            self._scale /= 2
            self._good_steps = 0
            return False
        if self.offload is not None:
            self.offload.step(self.optimizer)
        else:
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
        stage 3 gathers at the next forward): each unit all-gathered straight into `full`,
        from the master itself where it is `full`'s own shard (an all-gather in place),
        else from a copy of it, at most `IN_FLIGHT` at a time, so that refreshing holds at
        most a few shards beyond the parameters, never a second copy of them."""
        if self.stage == 3:
            return
        works: list[tuple[torch.Tensor | None, Any]] = []
        for unit in self.units:
            if len(works) == IN_FLIGHT:
                _finish_gather(*works.pop(0))
            if unit.wires.gather is not None:  # dequantized into `full`; the master apart
                works.append((None, comm.quantized_all_gather(
                    unit.master, unit.wires.gather, group=unit.group, async_op=True,
                    algorithm=self.algorithm, out=unit.full, block=unit.wires.block)))
                continue
            in_place = unit.master_in_full
            shard = unit.master if in_place else unit.master.to(unit.full.dtype, copy=True)
            works.append((None if in_place else shard,
                          comm.all_gather(shard, group=unit.group, async_op=True,
                                          algorithm=self.algorithm, out=unit.full)))
        for gathered, work in works:
            _finish_gather(gathered, work)

    @torch.no_grad()
    def publish_masters(self) -> None:
        """The master shards were set from outside the step (a checkpoint, a state_dict):
        copy them to where the module computes (offloaded: to the device) and rebuild the
        full parameters (`refresh_parameters`)."""
        if self.offload is not None:
            self.offload.publish()
        self.refresh_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the last step (and any accumulated under no_sync);
        `set_to_none` also releases the gradient shards until the next backward."""
        for unit in self.units:
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
    # torch overloads state_dict on its `destination`; this forwards every form
    def state_dict(  # type: ignore[override]
        self, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """The full (unsharded) state_dict of the wrapped module, in the parameters' own
        dtype, keys without a wrapper prefix. Collective: call it on every rank."""
        return zero_state.full_state(self)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False):
        """Load a full state_dict (as `state_dict` returns or the unwrapped module's);
        each rank keeps its shard. Collective."""
        zero_state.load_full_state(self, state_dict, strict)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The full optimizer state_dict, as the optimizer built by the factory on the
        unwrapped module would return it. Collective."""
        return zero_state.full_optimizer_state(self)

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state_dict (as `optimizer_state_dict` returns)."""
        zero_state.load_full_optimizer_state(self, state_dict)

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
        materialized, plus separate master shards), gradients, optimizer state and the
        frozen parameters sharded at stage 3 (their shards and what is gathered). With
        offload these count the compute device's tensors only ("master": stage 3's
        resident shards), and "host_master", "host_grads" and "host_optimizer" what the
        host keeps."""
        held = {**unit_bytes(self.units), "optimizer": optimizer_bytes(self.optimizer),
                "frozen": sum(b for key, b in unit_bytes(self.frozen).items() if key != "grads")}
        if self.offload is None:
            return held
        return {**held, "master": self.offload.device_bytes(), "optimizer": 0,
                **self.offload.host_bytes(held["optimizer"])}


def _compiled_units(module: nn.Module, chain: list[list[Unit]], frozen: list[Unit]
                    ) -> frozenset[int]:
    """Stage 3: the places in `chain` whose trained parameters all get their gradients at
    once, in one compiled block's backward (dtrain.models.compiled `gradients_together`)."""
    block = {id(p): k for k, params in enumerate(gradients_together(module)) for p in params}
    places = set()
    for k, units in enumerate(chain):
        blocks = {block.get(id(p)) for u in units if u not in frozen for p in u.flat.params}
        if len(blocks) == 1 and None not in blocks:
            places.add(k)
    return frozenset(places)


def _finish_gather(copy: torch.Tensor | None, work: Handle) -> None:
    """Wait for a refresh's all-gather and release its input copy, if any, at once (the
    finished collective's handle may keep it until the garbage collector finds the
    handle)."""
    work.wait()
    if copy is not None:
        copy.untyped_storage().resize_(0)
