"""Data parallelism: every dp rank holds the whole model (or its tp blocks) and a
DataParallel all-reduces the gradients (dtrain.DataParallel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain.layout import Layout
from dtrain.layouts.holding import Holding, build_optimizer
from dtrain.layouts.state import Names, Tensors
from dtrain.mesh import Mesh
from dtrain.parallel import compression
from dtrain.parallel.clip import GradPart
from dtrain.parallel.data_parallel import DataParallel


def data_parallel(module: nn.Module, group: Any, config: Any, live: Any = None) -> DataParallel:
    """`module` in a DataParallel over `group` (or the live replicas) as `[parallel]` says:
    bucket size, gradient dtype, compression (PowerSGD from the end of the learning-rate
    warm-up: its first, large gradients would take many steps of error feedback)."""
    pc = config.parallel
    compressor = None if pc.compression == "none" else compression.make(
        pc.compression, rank=pc.compression_rank, start_iter=config.optimizer.warmup_steps)
    return DataParallel(module, group=None if live else group, bucket_mb=pc.bucket_mb,
                        grad_dtype=None if pc.grad_dtype == "fp32" else pc.grad_dtype,
                        live=live, compression=compressor)


class Replicated(Holding):
    """The model, whole or split over tp, replicated over dp with DataParallel (or over
    the live replicas of each step, `live`)."""

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, config: Any,
                 live: Any = None) -> None:
        self.layout, self.names = layout, Names(model, tp=(mesh.coords["tp"], layout.tp))
        self.module = data_parallel(model, mesh.group("dp"), config, live)
        self.optimizers = [build_optimizer(model.parameters(), config.optimizer)]
        self.held = [Tensors(self.names, list(model.parameters()), self.optimizers[0],
                             dp=(mesh.coords["dp"], layout.dp))]
        self.groups = {"tp": mesh.group("tp")}
        self.loss_group = mesh.group("dp")
        self.accum = config.train.grad_accum

    def grad_parts(self) -> list[GradPart]:
        return self.module.grad_parts(is_split=self.names.is_split)
