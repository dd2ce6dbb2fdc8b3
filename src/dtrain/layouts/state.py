"""What a checkpoint saves of a Holding, and restores into it: `HeldState`.

A Holding (dtrain.layouts.holding) is the step the training loop drives; its `saved`
is this, the side the checkpoint code sees (dtrain.checkpoint.Checkpointable): the pieces
of the logical tensors its parts hold, the optimizers' scalars, the names of tied weights,
who writes a checkpoint together, fp16's loss scale, and what only this rank has
(`extras`: DataParallel's compression state, the sync groups' outer optimizer).

    pieces, scalars = holding.saved.state()
    holding.saved.restore(Checkpoint(path))        # whatever layout saved it
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from dtrain.checkpoint.checkpointable import CheckpointGroup
from dtrain.checkpoint.universal import Checkpoint, Piece
from dtrain.data_parallel import DataParallel
from dtrain.layouts.parts import Names, Part, collect
from dtrain.mesh import Dims
from dtrain.sync.diloco import DiLoCo

if TYPE_CHECKING:
    from dtrain.models.weights import SlicedWeights


class RankExtra(Protocol):
    """Something only this rank keeps across checkpoints, beside the model and optimizer:
    written to its own file with the RNG state (a checkpoint of the same ranks reads it)."""

    def state(self) -> dict[str, torch.Tensor]:
        """Its tensors, under keys no other extra uses."""

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `state()`'s tensors (every key of the rank's file is given)."""


class LossScaled(Protocol):
    """A strategy with fp16's dynamic loss scale (ZeRO)."""

    loss_scale: float


@dataclass
class HeldState:
    """A Holding's parameters and optimizer state as the checkpoint code sees them.

    Args:
        dims: the degrees the Holding is laid out by (the checkpoint's metadata).
        optimizers: its optimizers, one learning-rate scheduler each.
        parts: how its parameters are held (dtrain.layouts.parts).
        names: their logical names.
        checkpoint_group: who writes a checkpoint together (dtrain.checkpoint.universal
            .save's `group`): "world", a group (a sync group's ranks), or None (this rank
            alone).
        writes_checkpoint: False where another process writes this rank's share (a
            parameter server's optimizer state).
        scaled: the strategy whose fp16 loss scale is saved (None: no loss scaling).
        extras: what only this rank keeps (RankExtra).
    """

    dims: Dims
    optimizers: list[torch.optim.Optimizer]
    parts: list[Part]
    names: Names
    checkpoint_group: CheckpointGroup = "world"
    writes_checkpoint: bool = True
    scaled: LossScaled | None = None
    extras: list[RankExtra] = field(default_factory=list)

    @property
    def loss_scale(self) -> float:
        """fp16's dynamic loss scale (1.0 without one)."""
        return 1.0 if self.scaled is None else self.scaled.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if self.scaled is not None:
            self.scaled.loss_scale = value

    def state(self, only: Collection[str] | None = None) -> tuple[list[Piece], dict[str, Any]]:
        """This rank's pieces of the logical tensors and the optimizer scalars; `only`: of
        these parameters alone (None: all)."""
        return collect(self.parts, only)

    def restore(self, ckpt: Checkpoint | SlicedWeights) -> None:
        """Set this rank's parameters and optimizer state from `ckpt`, whatever layout
        saved it."""
        for part in self.parts:
            part.restore(ckpt)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What this rank keeps for itself across checkpoints: every extra's tensors."""
        return {k: v for extra in self.extras for k, v in extra.state().items()}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `rank_state()`'s tensors (a checkpoint of the same ranks)."""
        for extra in self.extras:
            extra.load(state)

    def aliases(self) -> dict[str, str]:
        """state_dict keys that name the same tensor as another (tied weights)."""
        return self.names.aliases()


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` whose keys start with `prefix`, without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class CompressionState:
    """The compression state (error feedback, warm starts) of every DataParallel inside
    `module`, as a RankExtra (keys `compression/I/...`)."""

    def __init__(self, module: nn.Module) -> None:
        self.wrappers = [m for m in module.modules() if isinstance(m, DataParallel)]

    def state(self) -> dict[str, torch.Tensor]:
        return {f"compression/{i}/{k}": v for i, wrapper in enumerate(self.wrappers)
                for k, v in wrapper.compression_state().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for i, wrapper in enumerate(self.wrappers):
            wrapper.load_compression_state(_under(state, f"compression/{i}/"))


class OuterState:
    """The sync groups' outer optimizer (dtrain.sync.diloco) as a RankExtra (key `outer`:
    its nested lists and SGD state as one blob); `loaded` brings what forward reads up to
    date after the synced tensors are set."""

    def __init__(self, outer: DiLoCo, loaded: Callable[[], None]) -> None:
        self.outer, self.loaded = outer, loaded

    def state(self) -> dict[str, torch.Tensor]:
        blob = io.BytesIO()
        torch.save(self.outer.state_dict(), blob)
        return {"outer": torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if "outer" in state:  # this rank's own checkpoint file
            blob = io.BytesIO(state["outer"].numpy().tobytes())
            self.outer.load_state_dict(torch.load(blob, weights_only=True))
            self.loaded()
