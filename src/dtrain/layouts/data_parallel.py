"""Data parallelism: every dp rank holds the whole model (or its tp blocks) and a
DataParallel all-reduces the gradients (dtrain.DataParallel)."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.comm import GroupLike
from dtrain.config import Config
from dtrain.job_layout import Layout
from dtrain.layouts.held import Names, Tensors, expert_ranks, replica_ranks
from dtrain.layouts.holding import Holding, build_optimizer, under
from dtrain.mesh import Mesh
from dtrain.parallel.averaging import Averaging
from dtrain.parallel.clip import GradPart
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.sync import compression


def data_parallel(module: nn.Module, group: GroupLike, config: Config,
                  averaging: Averaging | None = None,
                  expert_group: GroupLike = None) -> DataParallel:
    """`module` in a DataParallel over `group` (or by `averaging`) as `[comm]` says:
    bucket size, gradient dtype, compression (PowerSGD from the end of the learning-rate
    warm-up: its first, large gradients would take many steps of error feedback)."""
    cc = config.comm
    compressor = None if cc.compression == "none" else compression.make(
        cc.compression, rank=cc.compression_rank, start_iter=config.optimizer.warmup_steps)
    return DataParallel(module, group=None if averaging else group, bucket_mb=cc.bucket_mb,
                        grad_dtype=None if cc.grad_dtype == "fp32" else cc.grad_dtype,
                        averaging=averaging, compression=compressor,
                        expert_group=expert_group)


def compression_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The compression state (error feedback, warm starts) of every DataParallel inside
    `module`, as one rank's tensors for its checkpoint file."""
    wrappers = [m for m in module.modules() if isinstance(m, DataParallel)]
    return {f"compression/{i}/{k}": v for i, wrapper in enumerate(wrappers)
            for k, v in wrapper.compression_state().items()}


def load_compression_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Continue every DataParallel inside `module` from `compression_state()`'s tensors."""
    wrappers = [m for m in module.modules() if isinstance(m, DataParallel)]
    for i, wrapper in enumerate(wrappers):
        wrapper.load_compression_state(under(state, f"compression/{i}/"))


class Replicated(Holding):
    """The model, whole or split over tp, replicated over dp with DataParallel (or over
    the replicas an `averaging` chooses at each step, as live replicas do)."""

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        self.layout, self.names = layout, Names.of(model, mesh, layout)
        self.notes = notes
        experts, _ = expert_ranks(mesh)  # edp (x cp)
        replicas, place = replica_ranks(mesh)  # dp (x cp)
        self.module = data_parallel(model, replicas, config, averaging, experts)
        self.optimizers = [build_optimizer(model.parameters(), config.optimizer)]
        self.held = [Tensors(self.names, list(model.parameters()), self.optimizers[0],
                             dp=place)]
        self.groups = {"tp": mesh.group("tp"), **({"ep": mesh.group("ep")} if experts else {})}
        self.loss_group = replicas
        self.accum = config.train.grad_accum

    def grad_parts(self) -> list[GradPart]:
        return self.module.grad_parts(is_split=self.names.is_split)

    def rank_state(self) -> dict[str, torch.Tensor]:
        return compression_state(self.module)

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        load_compression_state(self.module, state)
