"""Flat units: parameters packed into one buffer that is split into equal shards.

Sharded data parallelism keeps, on each of N ranks, only 1/N of every unit's parameters,
gradients and optimizer state. A unit lays its parameters end to end in one flat buffer,
padded with zeros to a multiple of N, so that shard r is simply elements
[r*S, (r+1)*S) with S = padded / N: one reduce-scatter gives every rank its gradient shard
and one all-gather rebuilds the parameters. Inside a unit, parameters are ordered by their
optimizer parameter group, so each group is one contiguous range and a rank's shard meets
it in at most one piece (`FlatUnit.pieces`): the optimizer steps those pieces with the
group's own options (lr, weight decay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from dtrain.data_parallel.buckets import cut


@dataclass(frozen=True)
class Span:
    """Elements [lo, hi) of one parameter (flattened) that sit at [at, at + hi - lo) of a
    flat range."""

    name: str
    lo: int
    hi: int
    at: int


@dataclass
class FlatUnit:
    """Parameters (in order) in one flat buffer of `padded` elements, `ranks` shards."""

    names: list[str]
    params: list[nn.Parameter]
    groups: list[int]  # optimizer parameter group of each parameter (non-decreasing)
    ranks: int

    def __post_init__(self) -> None:
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_size = max(1, -(-total // self.ranks))
        self.padded = self.shard_size * self.ranks

    def shard(self, rank: int) -> tuple[int, int]:
        """The flat range of `rank`'s shard."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(group, lo, hi): where each parameter group meets `rank`'s shard, in shard
        coordinates (padding excluded)."""
        start, end = self.shard(rank)
        out = []
        for group in dict.fromkeys(self.groups):
            members = [k for k, g in enumerate(self.groups) if g == group]
            g_lo = self.offsets[members[0]]
            g_hi = self.offsets[members[-1]] + self.params[members[-1]].numel()
            lo, hi = max(start, g_lo), min(end, g_hi)
            if lo < hi:
                out.append((group, lo - start, hi - start))
        return out

    def spans(self, lo: int, hi: int) -> list[Span]:
        """The parameters' elements that flat range [lo, hi) holds, in order."""
        out = []
        for name, p, offset in zip(self.names, self.params, self.offsets, strict=True):
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                out.append(Span(name, a - offset, b - offset, a - lo))
        return out


_T = TypeVar("_T", bound=torch.Tensor)  # parameters, or any tensors


def split_by_size(named: list[tuple[str, _T]], max_bytes: int,
                  together: Sequence[Sequence[torch.Tensor]] = ()
                  ) -> list[list[tuple[str, _T]]]:
    """Consecutive runs of parameters of about `max_bytes` each, never mixing dtypes or
    devices (a parameter larger than the cap gets a run of its own). Consecutive
    parameters of one list of `together` (a compiled block's, whose gradients come at
    once: dtrain.models.compiled `gradients_together`) start a run of their own, cut
    only if they are over the cap together (dtrain.data_parallel.buckets `cut`)."""
    burst = {id(p): k for k, params in enumerate(together) for p in params}
    return cut(named, max_bytes, lambda item: item[1].numel() * item[1].element_size(),
               lambda item: (item[1].dtype, item[1].device),
               lambda item: burst.get(id(item[1])))
