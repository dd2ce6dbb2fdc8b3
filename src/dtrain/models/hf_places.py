"""Where each of dtrain's tensors lives in a Hugging Face model folder (`HFName`): one
tensor of its own (its name), one tensor per expert (`Stacked`: dtrain stacks a MoE layer's
experts, the folders of Mixtral and Qwen3-MoE keep them apart), or nowhere (`Zeros`).
dtrain.models.convert names them; dtrain.models.weights reads them and the exporter
(dtrain.tools.export_hf) writes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacked:
    """A dtrain tensor (E, rows, cols) of E experts that Hugging Face's files keep as
    tensors of their own per expert: `parts` name patterns (with `{e}`, the expert's index)
    whose (rows_i, cols) tensors, concatenated along rows, make expert e's (rows, cols)
    (a fused gate and up projection has two parts)."""

    parts: tuple[str, ...]
    count: int

    def names(self) -> list[str]:
        """Every Hugging Face tensor name it covers, expert by expert."""
        return [part.format(e=e) for e in range(self.count) for part in self.parts]

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """dtrain's (E, rows, cols) tensor as the Hugging Face tensors (equal parts)."""
        return {part.format(e=e): piece.contiguous().clone()
                for e in range(self.count)
                for part, piece in zip(self.parts, tensor[e].chunk(len(self.parts)),
                                       strict=True)}


@dataclass(frozen=True)
class Zeros:
    """A dtrain tensor of `shape` that Hugging Face's format has no place for and that its
    model computes as zeros (a softmax router's unused balancing bias)."""

    shape: tuple[int, ...]


HFName = str | Stacked | Zeros
"""Where a dtrain tensor lives in a Hugging Face folder: one tensor's name, one per expert,
or nowhere (zeros)."""
