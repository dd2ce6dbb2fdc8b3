"""Sharded data parallelism: parameters, gradients and optimizer state split over dp
(dtrain.ZeRO stages 1-3), on the whole model or its tp blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain.adapters.lora import frozen_base
from dtrain.comm import GroupLike
from dtrain.config import Config
from dtrain.data_parallel.averaging import Averaging
from dtrain.data_parallel.clip import GradPart
from dtrain.data_parallel.zero import ZeRO
from dtrain.layouts.holding import Holding
from dtrain.layouts.parts import FrozenShards, Names, Shards, expert_group, untrained
from dtrain.layouts.state import HeldState
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.optim import build_optimizer


def zero_of(module: nn.Module, group: GroupLike, stage: int, config: Config,
            device: torch.device, averaging: Averaging | None = None,
            expert_group: GroupLike = None, frozen: Sequence[nn.Parameter] = ()) -> ZeRO:
    """`module` wrapped in ZeRO at `stage` over `group` as `[parallel]` (its mixed
    precision), `[comm]` and `[optimizer]` say, each shard also averaged by `averaging` if
    given, split experts sharded over `expert_group` (the ranks holding the same experts);
    a module built in split form gets its shards (only) on `device`; `[memory] offload`
    puts the optimizer shards on the host; at stage 3 the `frozen` parameters (a LoRA
    run's base) are sharded too."""
    pc = config.parallel
    mixed = None if pc.mixed_precision == "fp32" else pc.mixed_precision
    init.allocate_buffers(module, device)
    return ZeRO(module, lambda _: build_optimizer(module.parameters(), config.optimizer),
                stage=stage, group=group, bucket_mb=config.comm.bucket_mb,
                mixed_precision=mixed, device=device, averaging=averaging,
                expert_group=expert_group,
                offload_device="cpu" if config.memory.offload == "optimizer" else None,
                frozen=frozen)


class Sharded(Holding):
    """The model, whole or split over tp, sharded over dp by one ZeRO wrapper (split
    experts over the ranks holding the same experts)."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        self.dims, self.names = mesh.dims, Names.of(model, mesh)
        self.notes = notes
        same = mesh.group("dp_cp")  # the ranks holding the same parameters
        self.module = self.zero = zero_of(model, same, mesh.dims.zero, config,
                                          mesh.world.device, averaging, expert_group(mesh),
                                          frozen=frozen_base(model))
        self.optimizers = [self.zero.optimizer]
        sharded = {id(p) for unit in self.zero.frozen for p in unit.flat.params}
        self.parts = [Shards(self.names, self.zero),
                      *([FrozenShards(self.names, self.zero)] if sharded else []),
                      *untrained(self.names, [model], mesh.place("dp_cp"), mesh.world.device,
                                 apart=sharded)]
        self.saved = HeldState(self.dims, self.optimizers, self.parts, self.names,
                               scaled=self.zero)
        self.groups = {"dp": same, "tp": mesh.group("tp")}  # experts: dp too
        self.loss_group = same
        self.accum = config.train.grad_accum

    def grad_parts(self) -> list[GradPart]:
        return self.zero.grad_parts(is_split=self.names.is_split, counted=self.names.counted)

    def synchronized(self) -> None:
        self.zero.refresh_parameters()

    def backward(self, loss: torch.Tensor) -> None:
        self.zero.backward(loss)  # scales the loss under fp16

    def clip_grad_norm_(self, max_norm: float) -> float:
        if self.dims.tp == 1:  # ZeRO's own also skips a step's clip on fp16 overflow
            return float(self.zero.clip_grad_norm_(max_norm))
        return super().clip_grad_norm_(max_norm)
