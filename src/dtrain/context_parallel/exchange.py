"""The differentiable exchanges context parallelism moves activations with.

- `gather_sequence`: every rank's tokens, concatenated in rank order along the sequence
  (dimension 2 of (batch, heads, time, head dim)); backward sums the gradient over the
  group and keeps this rank's tokens' (a reduce-scatter).
- `whole_sequence`: the whole of a (batch, time) tensor of token ids, targets or
  positions from every rank's chunks, in sequence order (not differentiable: what crosses
  chunk boundaries as integers, as multi-token prediction's tokens ahead do).
- `all_to_all`: split along one dimension, send part j to rank j, concatenate what
  arrives along another (Ulysses turns sequence shards into head shards with it, and
  back); backward is the exchange the other way.
"""

from __future__ import annotations

import torch

from dtrain import comm
from dtrain.context_parallel.chunks import unshard

Ctx = torch.autograd.function.FunctionCtx


class _GatherCtx(Ctx):
    """_Gather's ctx as its forward fills it (torch types a ctx as a bare FunctionCtx)."""

    group: comm.Group


class _AllToAllCtx(Ctx):
    """_AllToAll's ctx as its forward fills it."""

    group: comm.Group
    split: int
    cat: int


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _GatherCtx, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        b, h, t, d = x.shape
        whole = comm.all_gather(x.contiguous(), group=group)
        return whole.view(group.size, b, h, t, d).permute(1, 2, 0, 3, 4).reshape(
            b, h, group.size * t, d)

    @staticmethod
    def backward(ctx: _GatherCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        b, h, whole, d = grad.shape
        t = whole // group.size
        parts = grad.reshape(b, h, group.size, t, d).permute(2, 0, 1, 3, 4).contiguous()
        mine = comm.reduce_scatter(parts, op="sum", group=group)
        return mine.view(b, h, t, d), None


def gather_sequence(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """(batch, heads, time, dim) of every rank, concatenated along time in rank order."""
    return x if group.size == 1 else _Gather.apply(x, group)


def whole_sequence(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """(batch, 2 x cp chunks) in sequence order from every rank's (batch, its two chunks)
    of `x` (dtrain.context_parallel.chunks.shard's layout): one all-gather, no gradient."""
    if group.size == 1:
        return x
    every = comm.all_gather(x.contiguous(), group=group).view(group.size, *x.shape)
    return unshard(list(every.unbind(0)), dim=1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _AllToAllCtx, x: torch.Tensor, group: comm.Group, split: int,
                cat: int) -> torch.Tensor:
        ctx.group, ctx.split, ctx.cat = group, split, cat
        parts = torch.stack(x.chunk(group.size, dim=split)).contiguous()
        got = comm.all_to_all(parts, group=group).view(parts.shape)
        return torch.cat(got.unbind(0), dim=cat)

    @staticmethod
    def backward(ctx: _AllToAllCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(grad, ctx.group, ctx.cat, ctx.split), None, None, None


def all_to_all(x: torch.Tensor, group: comm.Group, split: int, cat: int) -> torch.Tensor:
    """`x` cut into group-size equal parts along `split`, part j sent to rank j, the
    parts received concatenated along `cat` in rank order (differentiable)."""
    return x if group.size == 1 else _AllToAll.apply(x, group, split, cat)
