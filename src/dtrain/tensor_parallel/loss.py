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

The same module computes the loss chunk by chunk from the hidden states and the
column-parallel head (`chunked`, dtrain.models.chunked_loss): the three numbers are
all-reduced per chunk of tokens, and no rank holds more than one chunk's block of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.models.chunked_loss import (
    linear_cross_entropy,
    plain_head,
    softmax_cross_entropy_,
    softmax_to_gradient_,
)
from dtrain.tensor_parallel.functions import copy_to_group, gather_sequence
from dtrain.tensor_parallel.layers import ColumnParallelLinear


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
        if z is logits:  # the softmax is made in place: never in the caller's logits
            z = z.clone()
        loss, local, here = softmax_cross_entropy_(z, target, GroupVocabulary(group, algorithm),
                                                   ignore_index)
        ctx.save_for_backward(z, local, here, target == ignore_index)  # z: the softmax
        ctx.dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx: _CrossEntropyCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward runs once per forward "
                               "(it turns the saved softmax into the gradient in place)")
        ctx.consumed = True
        softmax, local, here, ignored = ctx.saved_tensors
        gradient = softmax_to_gradient_(softmax, local, here, grad.masked_fill(ignored, 0.0))
        return gradient.to(ctx.dtype), None, None, None, None


class GroupVocabulary:
    """The vocabulary split in equal blocks over `group`, rank r holding the r-th: the
    softmax's statistics all-reduced over it (dtrain.models.chunked_loss.VocabularySplit)."""

    def __init__(self, group: comm.Group, algorithm: str = "auto") -> None:
        self.group, self.algorithm = group, algorithm

    def first(self, width: int) -> int:
        return self.group.rank * width

    def all_max(self, x: torch.Tensor) -> None:
        comm.all_reduce(x, op="max", group=self.group, algorithm=self.algorithm)

    def all_sum(self, x: torch.Tensor) -> None:
        comm.all_reduce(x, group=self.group, algorithm=self.algorithm)


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
    """`vocab_parallel_cross_entropy` as a module, in place of `nn.CrossEntropyLoss`; with
    a column-parallel head, also chunk by chunk from the hidden states (`chunked`)."""

    def __init__(self, group: comm.GroupLike = None, ignore_index: int = -100,
                 reduction: str = "mean", algorithm: str = "auto") -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.group, self.reduction,
                                            self.ignore_index, self.algorithm)

    def refusal(self, head: nn.Module) -> str | None:
        """Why the loss cannot be computed chunk by chunk over `head` (None: it can): it
        must be a plain ColumnParallelLinear over this loss's group, its output not
        gathered, and the mean its reduction."""
        if self.reduction != "mean":
            return f"the vocab-parallel loss's reduction is {self.reduction!r}, not mean"
        why = plain_head(head, ColumnParallelLinear)
        if why is not None:
            return why
        assert isinstance(head, ColumnParallelLinear)  # plain_head checked its type
        if head.gather_output or head.group.size != self.group.size \
                or head.matmul is not F.linear:
            return ("the column-parallel head gathers its output, multiplies otherwise, or "
                    "is split over another group than the loss")
        return None

    def chunked(self, hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        """The mean loss of `targets` under `head(hidden)`, `chunk` tokens at a time, each
        rank multiplying its block of the head's rows (its vocabulary block).

        `hidden` reaches the head as the head itself would take it: copied to the group
        (its gradient, each rank's block's share, summed over it), or under sequence
        parallelism gathered whole from the ranks' parts (the gradient summed and cut
        back to this rank's part).

        Raises:
            ConfigError: `refusal(head)` says why not.
        """
        why = self.refusal(head)
        if why is not None:
            raise ConfigError(f"train.loss = \"chunked\": {why}: use train.loss = \"plain\"")
        assert isinstance(head, ColumnParallelLinear)  # refusal checked it
        if head.sequence_gather is not None:
            whole = gather_sequence(hidden, self.group, self.algorithm)
        else:
            whole = copy_to_group(hidden, self.group, self.algorithm)
        return linear_cross_entropy(whole, head.weight, head.bias, targets, chunk,
                                    self.ignore_index, GroupVocabulary(self.group,
                                                                      self.algorithm))
