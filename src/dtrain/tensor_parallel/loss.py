"""Cross-entropy over logits split by vocabulary, without gathering them (Megatron-LM).

The output layer of a tensor-parallel language model is column-parallel: rank r holds the
logits of vocabulary entries [r*V/n, (r+1)*V/n). For each token,

    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v

needs only three numbers from across the group: the maximum (all-reduce max), and the sum
of exponentials with the target's logit (one all-reduce of both, since only the rank owning
the target contributes it). The gradient, softmax(z) - onehot(target), is computed on each
rank's block, in place of the softmax forward kept (as Megatron-LM does: one block of
logits alive in backward, so backward runs once per forward). Memory and traffic per
token: O(V/n) and three floats instead of O(V).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from dtrain import comm


class _CrossEntropyCtx(FunctionCtx):
    """_VocabParallelCrossEntropy's ctx as its forward fills it (torch types a ctx as a
    bare FunctionCtx)."""

    saved_tensors: tuple[torch.Tensor, ...]
    dtype: torch.dtype
    consumed: bool


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _CrossEntropyCtx, logits: torch.Tensor, target: torch.Tensor,
                group: comm.Group, algorithm: str, ignore_index: int) -> torch.Tensor:
        z = logits.float()
        width = z.shape[-1]
        first = group.rank * width
        top = z.max(dim=-1).values
        comm.all_reduce(top, op="max", group=group, algorithm=algorithm)
        z = z - top.unsqueeze(-1)
        outside = (target < first) | (target >= first + width)
        local = (target - first).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp_()
        sums = torch.stack([exp.sum(dim=-1), picked])
        comm.all_reduce(sums, group=group, algorithm=algorithm)
        total, picked = sums.unbind(0)
        loss = total.log() - picked
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(total.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, outside | ignored, ignored)
        ctx.dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx: _CrossEntropyCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward runs once per forward "
                               "(it turns the saved softmax into the gradient in place)")
        ctx.consumed = True
        softmax, local, not_here, ignored = ctx.saved_tensors
        softmax.scatter_add_(-1, local.unsqueeze(-1), -(~not_here).unsqueeze(-1).float())
        softmax.mul_(grad.masked_fill(ignored, 0.0).unsqueeze(-1))
        return softmax.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: comm.GroupLike = None, reduction: str = "mean",
                                 ignore_index: int = -100, algorithm: str = "auto"
                                 ) -> torch.Tensor:
    """Cross-entropy of `target` under logits whose last dimension is split across `group`.

    Args:
        logits: this rank's block of the logits, shape (..., V / group size).
        target: the whole vocabulary's ids, shape (...), the same on every rank.
        reduction: "mean" over targets that are not `ignore_index`, "sum", or "none".

    Equals `torch.nn.functional.cross_entropy` on the gathered logits.
    """
    g = comm.resolve(group)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use mean, sum or none")
    loss = _VocabParallelCrossEntropy.apply(logits, target, g, algorithm, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)


class VocabParallelCrossEntropy(nn.Module):
    """`vocab_parallel_cross_entropy` as a module, in place of `nn.CrossEntropyLoss`."""

    def __init__(self, group: comm.GroupLike = None, ignore_index: int = -100,
                 reduction: str = "mean", algorithm: str = "auto") -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.group, self.reduction,
                                            self.ignore_index, self.algorithm)
