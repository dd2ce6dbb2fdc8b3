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

Sequence parallelism (Korthikanti et al., 2022, section 4.2.2) keeps the activations
between those regions as each rank's part of the sequence (dimension 1 of [batch, time,
width]) and replaces `f` and `g` by the two halves of an all-reduce:

    gather_sequence          forward: all-gather       backward: reduce-scatter
    reduce_scatter_sequence  forward: reduce-scatter   backward: all-gather
    scatter_sequence         forward: keep own part    backward: all-gather

An all-gather and a reduce-scatter move what one all-reduce moves, so the communication
is the same; the norms, dropouts and residuals in between hold 1/tp of the activations.

Every function takes the tensor-parallel `group` (a dtrain Group) and an `algorithm` for
dtrain.comm; a group of one is the identity. Each is a graph break for torch.compile
(`torch.compiler.disable`): a compiled block (dtrain.models.compiled) runs its collectives
eagerly between compiled regions, which every block of the model shares.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from dtrain import comm

SEQUENCE = 1
"""The sequence dimension of a [batch, time, width] activation."""


def _all_reduce(x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=group, algorithm=algorithm)


def _gather(x: torch.Tensor, dim: int, group: comm.Group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    stacked = comm.all_gather(x.contiguous(), group=group, algorithm=algorithm)
    pieces = stacked.view(group.size, *x.shape)
    return torch.cat(pieces.unbind(0), dim=dim)


def _own_block(x: torch.Tensor, dim: int, group: comm.Group) -> torch.Tensor:
    """This rank's block of `x`'s dimension `dim`."""
    width = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * width, width).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: comm.Group,
                    algorithm: str) -> torch.Tensor:
    """The sum over ranks of `x`, this rank's block of `dim` only."""
    front = x.movedim(dim, 0).contiguous()  # each rank's block: a contiguous shard
    part = comm.reduce_scatter(front, group=group, algorithm=algorithm)
    return part.view(front.shape[0] // group.size, *front.shape[1:]).movedim(0, dim)


class CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient in backward: Megatron's `f`.

    Placed where a replicated activation enters split computation: each rank's branch
    contributes part of the input's gradient, and the sum is the whole of it.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.algorithm), None, None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: Megatron's `g`.

    Placed where split computation produces partial sums of a replicated activation; every
    rank then holds the whole result, and its gradient is already the same everywhere.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class Gather(torch.autograd.Function):
    """All-gather along `dim` in forward; keep this rank's block in backward (the gathered
    tensor's gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, dim: int, group: comm.Group,
                algorithm: str) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _own_block(grad, ctx.dim, ctx.group), None, None, None


class Scatter(torch.autograd.Function):
    """Keep this rank's block of `dim` in forward; all-gather it in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, dim: int, group: comm.Group,
                algorithm: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return _own_block(x, dim, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in forward, reduce-scatter in backward: sequence
    parallelism's `g` (Korthikanti et al., 2022), before a column-parallel layer. Each
    rank's split layer contributes part of the whole sequence's gradient; the sum over
    ranks is the whole of it, and each rank keeps its own part's."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _gather(x, SEQUENCE, group, algorithm)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, SEQUENCE, ctx.group, ctx.algorithm), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather in backward: sequence
    parallelism's `g-bar`, after a row-parallel layer. The partial sums of the whole
    sequence become each rank's part of the summed output."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _reduce_scatter(x, SEQUENCE, group, algorithm)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, SEQUENCE, ctx.group, ctx.algorithm), None, None


def _divides(x: torch.Tensor, dim: int, group: comm.Group, what: str) -> None:
    if x.shape[dim] % group.size:
        raise ValueError(f"{what} {x.shape[dim]} does not divide into {group.size} ranks")


@torch.compiler.disable
def copy_to_group(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """`f`: identity forward, gradient summed across `group` backward."""
    return x if group.size == 1 else CopyToGroup.apply(x, group, algorithm)


@torch.compiler.disable
def reduce_from_group(x: torch.Tensor, group: comm.Group,
                      algorithm: str = "auto") -> torch.Tensor:
    """`g`: summed across `group` forward, gradient passed through backward."""
    return x if group.size == 1 else ReduceFromGroup.apply(x, group, algorithm)


@torch.compiler.disable
def gather_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """The whole tensor from every rank's block of the last dimension (differentiable)."""
    return x if group.size == 1 else Gather.apply(x, -1, group, algorithm)


@torch.compiler.disable
def scatter_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """This rank's block of the last dimension, which must divide by the group size
    (differentiable)."""
    if group.size == 1:
        return x
    _divides(x, -1, group, "last dimension")
    return Scatter.apply(x, -1, group, algorithm)


@torch.compiler.disable
def gather_sequence(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """The whole sequence from every rank's part of dimension 1; the gradient is summed
    over `group` and cut back to this rank's part (differentiable)."""
    return x if group.size == 1 else GatherSequence.apply(x, group, algorithm)


@torch.compiler.disable
def reduce_scatter_sequence(x: torch.Tensor, group: comm.Group,
                            algorithm: str = "auto") -> torch.Tensor:
    """This rank's part of dimension 1 of the sum of `x` over `group`; the gradient is
    gathered whole (differentiable)."""
    return x if group.size == 1 else ReduceScatterSequence.apply(x, group, algorithm)


@torch.compiler.disable
def scatter_sequence(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """This rank's part of dimension 1, which must divide by the group size; the gradient
    is gathered whole (differentiable)."""
    if group.size == 1:
        return x
    _divides(x, SEQUENCE, group, "sequence length")
    return Scatter.apply(x, SEQUENCE, group, algorithm)


class SequenceGather:
    """`gather_sequence` for the column-parallel layers of one model, done once per input.

    Llama's q, k and v projections (and its gate and up) read the same norm output; they
    share one all-gather: the gathered tensor feeds each of them, autograd sums their
    gradients into it, and one reduce-scatter sends the sum back. The one entry kept is the
    last input (by identity, weakly, with its version and the grad mode) and its gathered
    tensor; it goes when that input is freed (at the latest when its module's forward
    returns), so it holds nothing past what autograd saves for the layers anyway. A
    recomputation (activation checkpointing) makes a new input and gathers it anew.
    """

    def __init__(self, group: comm.Group, algorithm: str = "auto") -> None:
        self.group, self.algorithm = group, algorithm
        self._last: tuple[weakref.ref, tuple[int, bool], torch.Tensor] | None = None

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_inference():  # no version counter to tell a change by
            return gather_sequence(x, self.group, self.algorithm)
        stamp = (x._version, torch.is_grad_enabled())
        last = self._last
        if last is not None and last[0]() is x and last[1] == stamp:
            return last[2]
        whole = gather_sequence(x, self.group, self.algorithm)
        owner = weakref.ref(self)  # the callback must not keep this object alive

        def forget(ref: weakref.ref) -> None:
            me = owner()
            if me is not None and me._last is not None and me._last[0] is ref:
                me._last = None

        self._last = (weakref.ref(x, forget), stamp, whole)
        return whole

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": None}  # a copy of the model starts empty
