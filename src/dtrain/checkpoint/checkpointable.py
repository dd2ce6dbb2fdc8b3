"""What a training checkpoint saves and restores: the interface a way of holding a model
gives dtrain.checkpoint.training.

Every layout's Holding (dtrain.layouts) is one; the checkpoint code sees nothing else of
it, so a new way of holding a model is saved and resumed by implementing these.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import torch

from dtrain.checkpoint.universal import Checkpoint, Piece
from dtrain.mesh import Dims

if TYPE_CHECKING:
    from dtrain.comm.registry import GroupLike

CheckpointGroup: TypeAlias = "GroupLike | Literal['world']"
"""The ranks that write one checkpoint together: a group, "world", or None (this rank
alone)."""


class Checkpointable(Protocol):
    """A rank's part of a model held in some layout, as the checkpoint code sees it."""

    dims: Dims
    """The degrees it is laid out by (written into the checkpoint's metadata)."""
    optimizers: list[torch.optim.Optimizer]
    """Its optimizers, one learning-rate scheduler each."""
    checkpoint_group: CheckpointGroup
    writes_checkpoint: bool
    """False where another process writes this rank's share (a parameter server's)."""
    loss_scale: float
    """fp16's dynamic loss scale (1.0 without)."""

    def state(self, only: Collection[str] | None = None) -> tuple[list[Piece], dict[str, Any]]:
        """The pieces this rank owns of the logical tensors (model and optimizer state),
        and the optimizers' options; `only`: of these parameters alone (by name; None:
        all), as an adapter checkpoint saves the adapters without their frozen base."""

    def restore(self, ckpt: Checkpoint) -> None:
        """Load this rank's pieces from a checkpoint of any layout."""

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What only this rank has (compression error feedback, an outer optimizer)."""

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `rank_state()`'s tensors, saved by the same rank."""

    def aliases(self) -> dict[str, str]:
        """state_dict keys that name the same tensor as another (tied weights)."""
