"""How a model tells the pipeline where to cut it: the `Stages` protocol.

A decoder-only language model is an input part (embeddings), a run of blocks, and an
output part (final norm, head). A model that names those parts can be cut into pipeline
stages by its blocks (dtrain.pipeline.cut): the first stage runs the input part, the last
the output part, every stage its consecutive blocks.

    class MyLM(nn.Module):
        def stage_parts(self):                      # module names, as in named_modules()
            return ["tok", "pos"], "layers", ["norm", "head"]
        def stage_in(self, idx):   return self.tok(idx) + self.pos(...)
        def stage_block(self, block, h):  return block(h)
        def stage_out(self, h):    return self.head(self.norm(h))

dtrain's GPT and Llama (both `StagedLM`s: their forward is their stages in a row), and
the Hugging Face causal LMs dtrain wraps (dtrain.models.hf), all implement it; a user's
own module (`arch = "custom"`) does too to be pipelined.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Stages(Protocol):
    """A model the pipeline can cut by its blocks."""

    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        """(the modules the first stage runs before the blocks, the name of the blocks'
        nn.ModuleList, the modules the last stage runs after them), as dotted names."""

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> the first block's input."""

    def stage_block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One block applied to hidden states (recomputing whatever per-position inputs it
        needs, such as rotary embeddings, from `h`'s shape)."""

    def stage_out(self, h: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits."""


class StagedLM(nn.Module):
    """A language model whose forward is its stages in a row: `stage_in`, every block of
    `stage_parts()`, `stage_out`, then with targets the loss of `self.loss_fn` (a module,
    so tensor parallelism can swap it for a vocab-parallel one). Subclasses set
    `block_size` (the longest input) and the stage methods."""

    block_size: int

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds "
                             f"block_size={self.block_size}")
        x = self.stage_in(idx)
        for block in self.get_submodule(self.stage_parts()[1]):
            x = self.stage_block(block, x)
        logits = self.stage_out(x)
        if targets is None:
            return logits
        return logits, self.loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def stage_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)
