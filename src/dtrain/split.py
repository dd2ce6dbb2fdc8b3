"""Where a parameter is cut between tensor-parallel ranks: a `Split`.

A `Split` says how one tensor maps to the blocks tensor-parallel ranks hold, which the
layers (dtrain.tensor_parallel), the models' expert weights (dtrain.models.moe) and the
layout-free checkpoints (dtrain.checkpoint) share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """Where a parameter is cut: along `dim`, in `chunks` fused parts.

    A `Split(dim, chunks)` cuts the tensor along `dim` into `chunks` equal parts (a fused
    weight such as attention's QKV has three) and each part into `size` equal blocks; rank
    r holds block r of every part, concatenated. With chunks = 1 this is a plain contiguous
    split.
    """

    dim: int
    chunks: int = 1

    def shard(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s block of `whole` (a new contiguous tensor)."""
        parts = whole.chunk(self.chunks, dim=self.dim)
        return torch.cat([p.chunk(size, dim=self.dim)[rank] for p in parts],
                         dim=self.dim).contiguous()

    def block_shape(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The shape of each rank's block of a tensor of `shape`."""
        return tuple(n // size if d == self.dim else n for d, n in enumerate(shape))

    def join(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's block, in rank order (inverse of `shard`)."""
        per_rank = [b.chunk(self.chunks, dim=self.dim) for b in blocks]
        return torch.cat([torch.cat([p[j] for p in per_rank], dim=self.dim)
                          for j in range(self.chunks)], dim=self.dim)
