"""Sharded data parallelism: parameters, gradients and optimizer state split over dp
(dtrain.ZeRO stages 1-3), on the whole model or its tp blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ShardGroups:
    """The groups ZeRO works over on this rank, from the mesh.

    Attributes:
        shard: the ranks a parameter's shards are spread over: those holding the same
            parameters (dp_cp), or under hybrid sharding those of one replica
            (dp_shard x cp).
        replicate: hybrid sharding: the ranks holding the same shards in the other
            replicas (dp_replicate), across which each reduced shard is averaged; None
            without it.
        experts: under expert parallelism, the ranks holding the same experts, over which
            they are sharded (edp: ep is folded over dp_shard x cp x tp; and dp_replicate
            without hybrid sharding); None without.
        first_replica: whether this rank is in the first replica, which writes the
            shards to checkpoints (the others hold the same).
    """

    shard: GroupLike
    replicate: GroupLike
    experts: GroupLike
    first_replica: bool

    @classmethod
    def of(cls, mesh: Mesh) -> ShardGroups:
        if mesh.size("dp_replicate") == 1:
            return cls(mesh.group("dp_cp"), None, expert_group(mesh), True)
        experts = mesh.group("edp") if mesh.size("ep") > 1 else None
        return cls(mesh.group("dp_shard", "cp"), mesh.group("dp_replicate"), experts,
                   mesh.coords["dp_replicate"] == 0)


def zero_of(module: nn.Module, groups: ShardGroups, stage: int, config: Config,
            device: torch.device, averaging: Averaging | None = None,
            frozen: Sequence[nn.Parameter] = ()) -> ZeRO:
    """`module` wrapped in ZeRO at `stage` over `groups` as `[parallel]` (its mixed
    precision), `[comm]` and `[optimizer]` say, each shard also averaged by `averaging` if
    given; a module built in split form gets its shards (only) on `device`; `[memory]
    offload` puts the optimizer shards on the host; at stage 3 the `frozen` parameters (a
    LoRA run's base) are sharded too."""
    pc = config.parallel
    mixed = None if pc.mixed_precision == "fp32" else pc.mixed_precision
    init.allocate_buffers(module, device)
    return ZeRO(module, lambda _: build_optimizer(module, config.optimizer),
                stage=stage, group=groups.shard, bucket_mb=config.comm.bucket_mb,
                mixed_precision=mixed, device=device, averaging=averaging,
                expert_group=groups.experts, replicate_group=groups.replicate,
                gather_dtype=_wire(config.comm.gather_dtype),
                reduce_dtype=_wire(config.comm.reduce_dtype), quant_block=config.comm.quant_block,
                offload_device="cpu" if config.memory.offload == "optimizer" else None,
                frozen=frozen)


def _wire(dtype: str) -> str | None:
    """A `[comm]` wire dtype as ZeRO takes it: "auto" (the compute dtype) is None."""
    return None if dtype == "auto" else dtype


class Sharded(Holding):
    """The model, whole or split over tp, sharded over dp by one ZeRO wrapper (split
    experts over the ranks holding the same experts)."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        self.dims, self.names = mesh.dims, Names.of(model, mesh)
        self.notes = notes
        groups = ShardGroups.of(mesh)
        self.module = self.zero = zero_of(model, groups, mesh.dims.zero, config,
                                          mesh.world.device, averaging,
                                          frozen=frozen_base(model))
        self.optimizers = [self.zero.optimizer]
        sharded = {id(p) for unit in self.zero.frozen for p in unit.flat.params}
        first = groups.first_replica
        self.parts = [Shards(self.names, self.zero, first),
                      *([FrozenShards(self.names, self.zero, first)] if sharded else []),
                      *untrained(self.names, [model], mesh.place("dp_cp"), mesh.world.device,
                                 apart=sharded)]
        self.saved = HeldState(self.dims, self.optimizers, self.parts, self.names,
                               scaled=self.zero)
        # the norm sums the shards of one replica (the others hold the same); experts: dp too
        self.groups = {"dp": groups.shard, "tp": mesh.group("tp")}
        self.loss_group = mesh.group("dp_cp")  # every rank's data
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
