"""The one interface every layout gives the training loop: `Holding`.

A Holding is what one rank holds of the model in a layout, and the few things a training
step does with it. The loop (dtrain.train.trainer) drives any layout through it:

    for step in steps:
        loss = holding.forward_backward([next(data) for _ in range(holding.accum)])
        holding.clip_grad_norm_(1.0)
        holding.step()
        holding.zero_grad()
        for scheduler in schedulers:      # one per `holding.optimizers`
            scheduler.step()

and saves or restores it through `holding.saved` (dtrain.layouts.state.HeldState: logical
tensor pieces, dtrain.checkpoint). A new way of holding a model is a new subclass in its
own module of dtrain.layouts, never a branch in the loop.

Sync groups (local SGD, DiLoCo: dtrain.sync.diloco) are no subclass and no wrapper: any
Holding takes an outer loop (`sync_with`), which its own `step` runs after the inner one,
so a Holding gains no member the outer loop could miss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from dtrain import timeline
from dtrain.checkpoint.checkpointable import CheckpointGroup
from dtrain.comm import GroupLike
from dtrain.data.sequences import Batch
from dtrain.data_parallel.clip import GradPart, clip_grad_norm_
from dtrain.layouts.parts import Part
from dtrain.layouts.state import HeldState, OuterState
from dtrain.mesh import Dims
from dtrain.models import loss_of_output
from dtrain.sync.diloco import DiLoCo

if TYPE_CHECKING:
    from dtrain.data_parallel import DataParallel
    from dtrain.data_parallel.zero import ZeRO

class Objective(Protocol):
    """The loss of a batch for the module a Holding runs (dtrain.train.objective's DPO;
    the model's own loss, `model_loss`, when a Holding has none)."""

    def __call__(self, module: nn.Module, batch: Batch | tuple[torch.Tensor, torch.Tensor]
                 ) -> torch.Tensor: ...


def model_loss(module: nn.Module, batch: Batch | tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
    """The loss of a model for a batch (inputs, targets, and where given packed documents'
    positions and the loss's weight): its (logits, loss) or its `.loss`."""
    if isinstance(batch, Batch):
        return loss_of_output(module(batch.inputs, batch.targets, **batch.model_kwargs()))
    return loss_of_output(module(*batch))


class Holding:
    """What one rank holds of the model in a layout, and the step the loop drives.

    Subclasses set, in their constructor:
        dims: the Dims they implement (their mesh's).
        module: the module(s) to run, as one nn.Module (train/eval mode follows it).
        optimizers: the optimizers whose learning rate a scheduler sets.
        parts: how the parameters are held, for steps and checkpoints (layouts.parts).
        groups: the mesh groups by axis ("dp", "tp", "pp") the clip sums over.
        loss_group: the group the reported loss is averaged over (None: this rank's own).
        saved: what a checkpoint saves and restores (layouts.state.HeldState).
        notes: what else the banner says of how the model is held (given to the
            constructor: sequence parallel, what is recomputed).

    and define `grad_parts()`: the strategy's own (DataParallel, ZeRO, Pipeline), told
    which parameters are tensor-parallel blocks.
    """

    dims: Dims
    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    parts: list[Part]
    groups: dict[str, GroupLike]
    saved: HeldState
    loss_group: GroupLike = None
    accum: int = 1
    """Batches of `train.batch_size / dp` one step takes (gradient accumulation)."""
    notes: tuple[str, ...] = ()
    outer: DiLoCo | None = None
    """The sync groups' outer loop, when the Holding is one of several (`sync_with`)."""
    lockstep: bool = True
    """Whether the world's ranks take each step together (False: parameter-server
    workers, each at its own pace, who never wait on each other)."""
    objective: Objective | None = None
    """How a batch's loss is computed (None: the model's own, `model_loss`); the Trainer
    sets it for `[objective] kind = "dpo"`."""

    def loss_of(self, batch: Batch | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The loss of `batch` by the objective."""
        if self.objective is None:
            return model_loss(self.module, batch)
        return self.objective(self.module, batch)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: Sequence[Batch | tuple[torch.Tensor, torch.Tensor]]
                         ) -> torch.Tensor:
        """Forward and backward of one step's batches (gradients accumulate, and ranks
        communicate after the last only); returns this rank's mean loss (0-d tensor)."""
        total = torch.zeros(())
        for i, batch in enumerate(batches):
            quiet = contextlib.nullcontext() if i == len(batches) - 1 else self.no_sync()
            with quiet:
                with timeline.span("forward", "forward"):
                    loss = self.loss_of(batch).float() / len(batches)
                with timeline.span("backward", "backward"):
                    self.backward(loss)
            total = total.to(loss.device) + loss.detach()
        return total

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside, backward accumulates without communicating."""
        # the kinds that do not override this hold a DataParallel or a ZeRO wrapper
        return cast("DataParallel | ZeRO", self.module).no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def evaluate(self, batch: Batch | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The loss of one held-out batch (no gradients)."""
        with torch.no_grad():
            return self.loss_of(batch)

    def infer(self, idx: torch.Tensor) -> torch.Tensor | None:
        """The logits of token ids `idx` (batch, time), every rank passing the same, one
        forward without gradients (generation; `module` in eval mode): under tensor
        parallelism this rank's part of the vocabulary; None on a rank that computes no
        logits (a pipeline's stages before the last)."""
        with torch.no_grad():
            out = self.module(idx)
        logits: torch.Tensor | None = getattr(out, "logits", out)  # a transformers output's
        return logits

    def grad_parts(self) -> list[GradPart]:
        """Every gradient this rank holds, and how it counts toward the global norm (each
        strategy's own `grad_parts`)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so the whole model's gradient norm is at most `max_norm`;
        returns that norm (collective over the mesh)."""
        return clip_grad_norm_(self.grad_parts(), max_norm, self.groups)

    def step(self) -> None:
        """Update the parameters from their gradients, then, every `sync.every` steps of
        an outer loop, from the other sync groups'."""
        self.update()
        if self.outer is not None and self.outer.step():
            self.synchronized()

    def update(self) -> None:
        """The inner step: each part's optimizer."""
        for part in self.parts:
            part.step()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    # ------------------------------------------------------------------ sync groups
    def sync_with(self, outer: DiLoCo, group: CheckpointGroup, note: str) -> None:
        """Make this Holding one of several sync groups, synchronized by `outer` (built
        over `synced()`): its step runs the outer loop's, its checkpoints are written by
        `group` (the sync group's ranks) with the outer optimizer's state, and the banner
        says `note`."""
        self.outer = outer
        self.saved.checkpoint_group = group
        self.saved.extras.append(OuterState(outer, self.synchronized))
        self.notes = (*self.notes, note)

    def synced(self) -> list[torch.Tensor]:
        """The tensors that make up this rank's copy of the model: what its optimizers step
        (parameters, tensor-parallel blocks, ZeRO shards)."""
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def synchronized(self) -> None:
        """The `synced()` tensors were set from the other sync groups: bring what forward
        reads up to date (ZeRO gathers its shards)."""

    def finish_rounds(self) -> None:
        """At the end: apply a synchronization still in flight (`sync.streaming`)."""
        if self.outer is not None:
            self.outer.flush()
            self.synchronized()

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Called once the state is in place (restored or fresh), before the first step."""

    def close(self) -> None:
        """Called after the last step."""

    def describe(self) -> str:
        """The layout in words, for the banner."""
        return "; ".join([self.dims.describe(), *self.notes])
