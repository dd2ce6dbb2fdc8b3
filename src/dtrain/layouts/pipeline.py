"""Pipeline parallelism: the model (or its tp blocks) cut into stages fed with
micro-batches (dtrain.pipeline), each of this rank's pieces data parallel or ZeRO over dp."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain import pipeline
from dtrain.config import Config
from dtrain.job_layout import Layout
from dtrain.layouts.data_parallel import compression_state, data_parallel, load_compression_state
from dtrain.layouts.held import Names, Shards, Tensors, expert_ranks, replica_ranks, untrained
from dtrain.layouts.holding import Batch, Holding, build_optimizer
from dtrain.layouts.zero import zero_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.parallel.averaging import Averaging
from dtrain.parallel.clip import GradPart
from dtrain.parallel.zero import ZeRO


class Pipelined(Holding):
    """This rank's pipeline pieces, each wrapped over dp, driven by the schedule."""

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        group, (dp, place) = mesh.group("pp"), replica_ranks(mesh)  # dp (x cp)
        self.layout, self.notes = layout, notes
        mine = pipeline.pieces_for(pipeline.cut(model, layout.pp * layout.virtual_stages),
                                   group)
        device = mesh.world.device  # a model built in split form: only my pieces get memory
        if not layout.zero:
            for piece in mine:
                init.allocate(piece, device)
        tied = pipeline.tied_weights(model, mine, group)
        self.names = Names.of(model, mesh, layout,
                              skip={id(p) for p, peer in tied if peer < group.rank()})
        experts, _ = expert_ranks(mesh)  # edp (x cp)
        if layout.zero:
            wrapped = [zero_of(piece, dp, config, device, averaging, experts)
                       for piece in mine]
            self.optimizers = [z.optimizer for z in wrapped]
            self.held = [*(Shards(self.names, z) for z in wrapped),
                         *untrained(self.names, mine, place, device)]
        else:
            wrapped = [data_parallel(piece, dp, config, averaging, experts) for piece in mine]
            params = list(nn.ModuleList(mine).parameters())
            self.optimizers = [build_optimizer(params, config.optimizer)]
            self.held = [Tensors(self.names, params, self.optimizers[0],
                                 dp=place)]
        self.module = nn.ModuleList(wrapped)
        self.pipe = pipeline.Pipeline(wrapped, group, microbatches=layout.microbatches,
                                      schedule=layout.schedule,
                                      loss_fn=pipeline.loss_of(model), tied=tied,
                                      extra_loss=pipeline.extra_loss_of(model, mine))
        self.groups = {"dp": dp, "tp": mesh.group("tp"), "pp": group,
                       **({"ep": mesh.group("ep")} if experts else {})}
        self.loss_group = dp

    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """The pipeline accumulates its micro-batches itself: one batch per step (its
        forwards and backwards interleave, with spans of their own)."""
        (x, y), = batches
        return self.pipe.step(x, y).detach()

    def synchronized(self) -> None:
        for piece in self.module:
            if isinstance(piece, ZeRO):
                piece.refresh_parameters()

    def grad_parts(self) -> list[GradPart]:
        return self.pipe.grad_parts(is_split=self.names.is_split)  # a tied copy counted once

    def rank_state(self) -> dict[str, torch.Tensor]:
        return compression_state(self.module)

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        load_compression_state(self.module, state)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.pipe.evaluate(x, y)

    def infer(self, idx: torch.Tensor) -> torch.Tensor | None:
        return self.pipe.infer(idx)  # the logits on the last stage's rank
