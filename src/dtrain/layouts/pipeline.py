"""Pipeline parallelism: the model (or its tp blocks) cut into stages fed with
micro-batches (dtrain.pipeline), each of this rank's pieces data parallel or ZeRO over dp."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain import pipeline
from dtrain.adapters.lora import compute_in, computed_in
from dtrain.comm import GroupLike
from dtrain.config import Config
from dtrain.data.sequences import IGNORE, Batch
from dtrain.data_parallel import DataParallel
from dtrain.data_parallel.averaging import Averaging
from dtrain.data_parallel.clip import GradPart
from dtrain.data_parallel.zero import ZeRO
from dtrain.layouts.data_parallel import data_parallel
from dtrain.layouts.holding import Holding
from dtrain.layouts.parts import Names, Shards, Tensors, expert_group, untrained
from dtrain.layouts.state import CompressionState, HeldState
from dtrain.layouts.zero import ShardGroups, zero_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.optim import build_optimizer
from dtrain.pipeline.pieces import counted_elsewhere, twins
from dtrain.pipeline.schedules import stage_balance


class Pipelined(Holding):
    """This rank's pipeline pieces, each wrapped over dp, driven by the schedule."""

    module: nn.ModuleList

    def __init__(self, model: nn.Module, mesh: Mesh, config: Config,
                 notes: tuple[str, ...] = (), averaging: Averaging | None = None) -> None:
        group, dp, place = mesh.group("pp"), mesh.group("dp_cp"), mesh.place("dp_cp")
        dims = self.dims = mesh.dims
        self.notes = notes
        stages = dims.pp * dims.virtual_stages
        balance = stage_balance(config.parallel.stage_layers, stages)
        mine = pipeline.pieces_for(pipeline.cut(model, stages, balance), group, dims.schedule)
        device = mesh.world.device  # a model built in split form: only my pieces get memory
        base = config.adapter.base_dtype if config.adapter.kind == "lora" else "float32"
        loss_fn = pipeline.loss_of(model)
        if base != "float32":  # the stages and the loss compute as the whole model would
            for piece in mine:
                compute_in(piece, getattr(torch, base))
            loss_fn = computed_in(loss_fn, getattr(torch, base))
        if not dims.zero:
            for piece in mine:
                init.allocate(piece, device)
        tied = pipeline.tied_weights(model, mine, group)
        self.names = Names.of(model, mesh, skip=counted_elsewhere(tied, group.rank()),
                              twins=twins(tied))
        experts = expert_group(mesh)
        wrapped: list[ZeRO] | list[DataParallel]
        reduced_over: GroupLike = dp  # the ranks whose gradient shards make up the norm
        if dims.zero:
            shard_groups = ShardGroups.of(mesh)
            reduced_over = shard_groups.shard
            wrapped = [zero_of(piece, shard_groups, dims.zero, config, device, averaging)
                       for piece in mine]
            self.optimizers = [z.optimizer for z in wrapped]
            self.parts = [*(Shards(self.names, z, shard_groups.first_replica)
                            for z in wrapped),
                         *untrained(self.names, mine, place, device)]
        else:
            wrapped = [data_parallel(piece, dp, config, averaging, experts) for piece in mine]
            params = list(nn.ModuleList(mine).parameters())
            self.optimizers = [build_optimizer(nn.ModuleList(mine), config.optimizer)]
            self.parts = [Tensors(self.names, params, self.optimizers[0],
                                 dp=place)]
        self.module = nn.ModuleList(wrapped)
        self.saved = HeldState(dims, self.optimizers, self.parts, self.names,
                               extras=[CompressionState(self.module)])
        overlap = dims.schedule == "dualpipev" and (  # a pair's backward beside its forward
            config.parallel.overlap_pairs == "on"
            or (config.parallel.overlap_pairs == "auto" and device.type == "cuda"))
        if overlap:
            mesh.second_lane()
        self.pipe = pipeline.Pipeline(wrapped, group, microbatches=dims.microbatches,
                                      schedule=dims.schedule,
                                      loss_fn=loss_fn, tied=tied,
                                      extra_loss=pipeline.extra_loss_of(model, mine),
                                      overlap=overlap)
        self.groups = {"dp": reduced_over, "tp": mesh.group("tp"), "pp": group,
                       **({"ep": mesh.group("ep")} if experts else {})}
        self.loss_group = dp

    def forward_backward(self, batches: Sequence[Batch | tuple[torch.Tensor, torch.Tensor]]
                         ) -> torch.Tensor:
        """The pipeline accumulates its micro-batches itself: one batch per step (its
        forwards and backwards interleave, with spans of their own)."""
        (batch,) = batches
        return self.pipe.step(*self._arguments(batch)).detach()

    def synchronized(self) -> None:
        for piece in self.module:
            if isinstance(piece, ZeRO):
                piece.refresh_parameters()

    def grad_parts(self) -> list[GradPart]:
        return self.pipe.grad_parts(is_split=self.names.is_split)  # a tied copy counted once

    def evaluate(self, batch: Batch | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.pipe.evaluate(*self._arguments(batch))

    def _arguments(self, batch: Batch | tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              list[float] | None]:
        """The pipeline's (inputs, targets, positions, weights) of a batch: its packed
        documents' positions, and where not every position is a target each
        micro-batch's weight, its share of the batch's (`Batch.weight` x its targets /
        the batch's), so the loss stays the mean over the step's targets."""
        if not isinstance(batch, Batch):
            x, y = batch
            return x, y, None, None
        weights = None
        if batch.weight is not None:
            counts = [int((t != IGNORE).sum()) for t in batch.targets.chunk(
                self.pipe.microbatches)]
            weights = [batch.weight * n / max(1, sum(counts)) for n in counts]
        return batch.inputs, batch.targets, batch.positions, weights

    def infer(self, idx: torch.Tensor) -> torch.Tensor | None:
        return self.pipe.infer(idx)  # the logits on the last stage's rank

