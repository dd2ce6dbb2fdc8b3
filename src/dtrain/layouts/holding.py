"""The one interface every layout gives the training loop: `Holding`.

A Holding is what one rank holds of the model in a layout, and the few things a training
step does with it. The loop (dtrain.train.trainer) drives any layout through it:

    for step in steps:
        loss = held.forward_backward([next(data) for _ in range(held.accum)])
        held.clip_grad_norm_(1.0)
        held.step()
        held.zero_grad()
        for scheduler in schedulers:      # one per `held.optimizers`
            scheduler.step()

and saves or restores it through `held.state()` / `held.restore(ckpt)` (logical tensor
pieces, dtrain.checkpoint). A new way of holding a model is a new subclass in its own
module of dtrain.layouts, never a branch in the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dtrain import timeline
from dtrain.checkpoint.checkpointable import CheckpointGroup
from dtrain.checkpoint.universal import Checkpoint, Piece
from dtrain.comm import GroupLike
from dtrain.config import OptimizerConfig
from dtrain.job_layout import Layout
from dtrain.layouts.held import Held, Names, collect
from dtrain.models import loss_of_output
from dtrain.parallel.clip import GradPart, clip_grad_norm_

Batch = tuple[torch.Tensor, torch.Tensor]


def model_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of a model for (inputs, targets): its (logits, loss) or its `.loss`."""
    return loss_of_output(module(x, y))


class Holding:
    """What one rank holds of the model in a layout, and the step the loop drives.

    Subclasses set, in their constructor:
        layout: the Layout they implement.
        module: the module(s) to run, as one nn.Module (train/eval mode follows it).
        optimizers: the optimizers whose learning rate a scheduler sets.
        held: how the parameters are held, for checkpoints and steps (layouts.state).
        names: the logical names of the parameters.
        groups: the mesh groups by axis ("dp", "tp", "pp") the clip sums over.
        notes: what else the banner says of how the model is held (given to the
            constructor: sequence parallel, what is recomputed).

    and define `grad_parts()`: the strategy's own (DataParallel, ZeRO, Pipeline), told
    which parameters are tensor-parallel blocks.
        loss_group: the group the reported loss is averaged over (None: this rank's own).
    """

    layout: Layout
    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    held: list[Held]
    names: Names
    groups: dict[str, GroupLike]
    loss_group: GroupLike = None
    accum: int = 1
    """Batches of `train.batch_size / dp` one step takes (gradient accumulation)."""
    checkpoint_group: CheckpointGroup = "world"
    """Who writes a checkpoint together (dtrain.checkpoint.universal.save's `group`)."""
    writes_checkpoint: bool = True

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward of one step's batches (gradients accumulate, and replicas
        communicate after the last only); returns this rank's mean loss (0-d tensor)."""
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            quiet = contextlib.nullcontext() if i == len(batches) - 1 else self.no_sync()
            with quiet:
                with timeline.span("forward", "forward"):
                    loss = model_loss(self.module, x, y).float() / len(batches)
                with timeline.span("backward", "backward"):
                    self.backward(loss)
            total = total.to(loss.device) + loss.detach()
        return total

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Inside, backward accumulates without communicating."""
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one held-out batch (no gradients)."""
        with torch.no_grad():
            return model_loss(self.module, x, y)

    def infer(self, idx: torch.Tensor) -> torch.Tensor | None:
        """The logits of token ids `idx` (batch, time), every rank passing the same, one
        forward without gradients (generation; `module` in eval mode): under tensor
        parallelism this rank's part of the vocabulary; None on a rank that computes no
        logits (a pipeline's stages before the last)."""
        with torch.no_grad():
            out = self.module(idx)
        return getattr(out, "logits", out)

    def grad_parts(self) -> list[GradPart]:
        """Every gradient this rank holds, and how it counts toward the global norm (each
        strategy's own `grad_parts`)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so the whole model's gradient norm is at most `max_norm`;
        returns that norm (collective over the mesh)."""
        return clip_grad_norm_(self.grad_parts(), max_norm, self.groups)

    def step(self) -> None:
        """Update the parameters from their gradients."""
        for h in self.held:
            h.step()

    def finish_rounds(self) -> None:
        """At the end: apply what is still in flight (a wrapper's, dtrain.layouts.synced)."""

    def synced(self) -> list[torch.Tensor]:
        """The tensors that make up this rank's copy of the model: what its optimizers step
        (parameters, tensor-parallel blocks, ZeRO shards)."""
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def synchronized(self) -> None:
        """The `synced()` tensors were set from the other replicas: bring what forward
        reads up to date (ZeRO gathers its shards)."""

    def zero_grad(self) -> None:
        for h in self.held:
            h.zero_grad()

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Called once the state is in place (restored or fresh), before the first step."""

    def close(self) -> None:
        """Called after the last step."""

    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """The layout in words, for the banner."""
        return "; ".join([self.layout.describe(), *self.notes])

    # ------------------------------------------------------------------ checkpoints
    @property
    def loss_scale(self) -> float:
        """fp16's dynamic loss scale (1.0 without one)."""
        return 1.0

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        pass

    def state(self) -> tuple[list[Piece], dict[str, Any]]:
        """This rank's pieces of the logical tensors and the optimizer scalars."""
        return collect(self.held)

    def restore(self, ckpt: Checkpoint) -> None:
        """Set this rank's parameters and optimizer state from `ckpt`, whatever layout
        saved it."""
        for h in self.held:
            h.restore(ckpt)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What this rank keeps for itself across checkpoints, beyond the model and
        optimizer (DataParallel's compression state; a wrapper's own, as the replicas'
        outer optimizer): nothing by default."""
        return {}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `rank_state()`'s tensors (a checkpoint of the same ranks)."""

    def aliases(self) -> dict[str, str]:
        return self.names.aliases()


def under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` whose keys start with `prefix`, without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def decay_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases, norms), as in GPT-2 training."""
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimizerConfig
                    ) -> torch.optim.Optimizer:
    """The configured optimizer (`[optimizer]`: name, lr, betas, momentum, weight_decay)."""
    groups = decay_groups(params, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    optimizer = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return optimizer(groups, lr=cfg.lr, betas=tuple(cfg.betas))
