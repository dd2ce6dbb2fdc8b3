"""Data parallelism: every dp rank holds the whole model (or its tp blocks) and a
DataParallel all-reduces the gradients (dtrain.DataParallel)."""

from __future__ import annotations

from torch import nn

from dtrain.comm import GroupLike
from dtrain.config import Config
from dtrain.data_parallel import DataParallel
from dtrain.data_parallel.averaging import Averaging
from dtrain.data_parallel.clip import GradPart
from dtrain.layouts.holding import Holding
from dtrain.layouts.parts import Names, Tensors, expert_group
from dtrain.layouts.state import CompressionState, HeldState
from dtrain.mesh import Mesh
from dtrain.optim import build_optimizer
from dtrain.sync import compression


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


class Replicated(Holding):
    """The model, whole or split over tp, replicated over dp with DataParallel (or over
    the replicas an `averaging` chooses at each step, as live replicas do)."""

    module: DataParallel

    def __init__(self, model: nn.Module, mesh: Mesh, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        self.dims, self.names = mesh.dims, Names.of(model, mesh)
        self.notes = notes
        experts = expert_group(mesh)
        same = mesh.group("dp_cp")  # the ranks holding the same parameters
        self.module = data_parallel(model, same, config, averaging, experts)
        self.optimizers = [build_optimizer(model, config.optimizer)]
        self.parts = [Tensors(self.names, list(model.parameters()), self.optimizers[0],
                              dp=mesh.place("dp_cp"))]
        self.saved = HeldState(self.dims, self.optimizers, self.parts, self.names,
                               extras=[CompressionState(self.module)])
        self.groups = {"tp": mesh.group("tp"), **({"ep": mesh.group("ep")} if experts else {})}
        self.loss_group = same
        self.accum = config.train.grad_accum

    def grad_parts(self) -> list[GradPart]:
        return self.module.grad_parts(is_split=self.names.is_split)
