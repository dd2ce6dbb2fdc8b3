"""Replicas that train alone and synchronize now and then (`sync.method` = local_sgd or
diloco): a Holding wrapped from outside by its outer loop.

Each replica (a block of the mesh's `dp_replicate` axis) holds the model in its own layout,
steps on its own data, and every `sync.every` steps averages with the others
(dtrain.parallel.sync.diloco.DiLoCo, over the tensors its Holding steps: `synced()`). The
wrapper adds that to the inner Holding's step and nothing else; each replica writes its
own checkpoints, and the outer optimizer's state goes with this rank's.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.checkpoint.checkpointable import CheckpointGroup
from dtrain.checkpoint.universal import Checkpoint, Piece
from dtrain.layouts.holding import Batch, Holding
from dtrain.parallel.clip import GradPart
from dtrain.parallel.sync.diloco import DiLoCo


class Synced(Holding):
    """`inner`, synchronized with the other replicas' by `outer` every few steps.

    Args:
        inner: this replica's Holding.
        outer: the synchronization (built over `inner.synced()`).
        checkpoint_group: the ranks of this replica, which write its checkpoints together.
        note: the banner's words for the synchronization.
    """

    def __init__(self, inner: Holding, outer: DiLoCo, checkpoint_group: CheckpointGroup,
                 note: str) -> None:
        self.inner, self.outer = inner, outer
        self.layout, self.module, self.optimizers = inner.layout, inner.module, inner.optimizers
        self.held, self.names, self.groups = inner.held, inner.names, inner.groups
        self.loss_group, self.accum = inner.loss_group, inner.accum
        self.writes_checkpoint = inner.writes_checkpoint
        self.checkpoint_group = checkpoint_group
        self.notes = (*inner.notes, note)

    # ------------------------------------------------------------------ the outer loop
    def step(self) -> None:
        """The inner step, and every `sync.every` steps the other replicas' average."""
        self.inner.step()
        if self.outer.step():
            self.inner.synchronized()

    def finish_rounds(self) -> None:
        """Apply a synchronization still in flight (`sync.streaming`), at the end."""
        self.inner.finish_rounds()
        self.outer.flush()
        self.inner.synchronized()

    def infer(self, idx: torch.Tensor) -> torch.Tensor | None:
        return self.inner.infer(idx)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """The inner Holding's, and the outer optimizer's state (nested lists and the
        outer SGD's state: one blob)."""
        blob = io.BytesIO()
        torch.save(self.outer.state_dict(), blob)
        outer = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)
        return {**self.inner.rank_state(), "outer": outer}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_rank_state({k: v for k, v in state.items() if k != "outer"})
        if "outer" in state:  # this rank's own checkpoint file
            blob = io.BytesIO(state["outer"].numpy().tobytes())
            self.outer.load_state_dict(torch.load(blob, weights_only=True))
            self.inner.synchronized()

    # ------------------------------------------------------------------ the inner Holding's
    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        return self.inner.forward_backward(batches)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner.evaluate(x, y)

    def grad_parts(self) -> list[GradPart]:
        return self.inner.grad_parts()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm_(max_norm)

    def synced(self) -> list[torch.Tensor]:
        return self.inner.synced()

    def synchronized(self) -> None:
        self.inner.synchronized()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return "; ".join([self.inner.describe(), *self.notes[len(self.inner.notes):]])

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.inner.loss_scale = value

    def state(self) -> tuple[list[Piece], dict[str, Any]]:
        return self.inner.state()

    def restore(self, ckpt: Checkpoint) -> None:
        self.inner.restore(ckpt)

    def aliases(self) -> dict[str, str]:
        return self.inner.aliases()
