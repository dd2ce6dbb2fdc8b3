"""The differentiable collectives of tensor parallelism: what crosses ranks, and its gradient.

Megatron-LM (Shoeybi et al., 2019, section 3) splits a layer's weight across the ranks of a
tensor-parallel group and needs just two conjugate operators to keep forward and backward
right:

    f = copy_to_group      forward: identity           backward: all-reduce (sum)
    g = reduce_from_group  forward: all-reduce (sum)   backward: identity

An MLP `Y = GeLU(X A) B` with A split by columns and B by rows runs `f` before A and `g`
after B: one all-reduce forward and one backward. Attention does the same with Q, K, V split
by heads. `gather_last` and `scatter_last` move between a tensor split along its last
dimension and the whole one (each the other's gradient).

Every function takes the tensor-parallel `group` (a dtrain Group) and an `algorithm` for
dtrain.comm; a group of one is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain import comm


def _all_reduce(x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=group, algorithm=algorithm)


def _gather_last(x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order."""
    stacked = comm.all_gather(x.contiguous(), group=group, algorithm=algorithm)
    pieces = stacked.view(group.size, *x.shape)
    return torch.cat(pieces.unbind(0), dim=-1)


def _own_slice(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """This rank's block of `x`'s last dimension."""
    width = x.shape[-1] // group.size
    return x[..., group.rank * width : (group.rank + 1) * width].contiguous()


class CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient in backward: Megatron's `f`.

    Placed where a replicated activation enters split computation: each rank's branch
    contributes part of the input's gradient, and the sum is the whole of it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.algorithm), None, None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: Megatron's `g`.

    Placed where split computation produces partial sums of a replicated activation; every
    rank then holds the whole result, and its gradient is already the same everywhere.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class GatherLast(torch.autograd.Function):
    """All-gather along the last dimension in forward; keep this rank's slice in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_slice(grad, ctx.group), None, None


class ScatterLast(torch.autograd.Function):
    """Keep this rank's slice of the last dimension in forward; all-gather it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.group, ctx.algorithm), None, None


def copy_to_group(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """`f`: identity forward, gradient summed across `group` backward."""
    return x if group.size == 1 else CopyToGroup.apply(x, group, algorithm)


def reduce_from_group(x: torch.Tensor, group: comm.Group,
                      algorithm: str = "auto") -> torch.Tensor:
    """`g`: summed across `group` forward, gradient passed through backward."""
    return x if group.size == 1 else ReduceFromGroup.apply(x, group, algorithm)


def gather_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """The whole tensor from every rank's block of the last dimension (differentiable)."""
    return x if group.size == 1 else GatherLast.apply(x, group, algorithm)


def scatter_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """This rank's block of the last dimension, which must divide by the group size
    (differentiable)."""
    if group.size == 1:
        return x
    if x.shape[-1] % group.size:
        raise ValueError(f"last dimension {x.shape[-1]} does not divide into {group.size} ranks")
    return ScatterLast.apply(x, group, algorithm)
