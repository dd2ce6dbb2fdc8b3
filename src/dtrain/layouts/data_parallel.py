"""Data parallelism: every dp rank holds the whole model (or its tp blocks) and a
DataParallel all-reduces the gradients (dtrain.DataParallel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain.layout import Layout
from dtrain.layouts.holding import Holding, build_optimizer
from dtrain.layouts.state import Names, Tensors
from dtrain.mesh import Mesh
from dtrain.parallel.clip import GradPart
from dtrain.parallel.data_parallel import DataParallel


class Replicated(Holding):
    """The model, whole or split over tp, replicated over dp with DataParallel (or over
    the live replicas of each step, `live`)."""

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, config: Any,
                 live: Any = None) -> None:
        pc = config.parallel
        self.layout, self.names = layout, Names(model, tp=(mesh.coords["tp"], layout.tp))
        self.module = DataParallel(model, group=None if live else mesh.group("dp"),
                                   bucket_mb=pc.bucket_mb, grad_dtype=pc.grad_dtype, live=live)
        self.optimizers = [build_optimizer(model.parameters(), config.optimizer)]
        self.held = [Tensors(self.names, list(model.parameters()), self.optimizers[0],
                             dp=(mesh.coords["dp"], layout.dp))]
        self.groups = {"tp": mesh.group("tp")}
        self.loss_group = mesh.group("dp")
        self.accum = config.train.grad_accum

    def grad_parts(self) -> list[GradPart]:
        return self.module.grad_parts(is_split=self.names.is_split)
