"""Layers whose weight is split across a tensor-parallel group (Megatron-LM, section 3).

    ColumnParallelLinear   Y_i = X A_i       output features split; gather optional
    RowParallelLinear      Y = sum_i X_i A_i  input features split; all-reduce, bias once
    VocabParallelEmbedding rows of the table split; ids outside a rank's rows give zeros
    SharedAcrossGroup      no weight: an activation every rank reads whole, gradient summed

A column-parallel layer followed by a row-parallel one (an MLP, or attention's QKV and
output projection) communicates once forward and once backward. Under sequence
parallelism (dtrain.tensor_parallel.sequence) the column-parallel layer all-gathers its
input from each rank's part of the sequence and the row-parallel one reduce-scatters its
output back into parts, in place of the two all-reduces. Each layer's `splits`
says how its parameters are cut (dtrain.split.Split), which is what
`parallelize`, the state functions and gradient clipping read.

Built directly, a layer initializes its own block like the torch layer it replaces;
`parallelize` instead copies the blocks of an existing model's weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.models.float8 import Matmul
from dtrain.models.recompute import recomputed_within
from dtrain.split import Split
from dtrain.tensor_parallel.functions import (
    SequenceGather,
    copy_to_group,
    gather_last,
    gather_sequence,
    gathered_linear,
    matmul_keeping_part,
    reduce_from_group,
    reduce_scatter_sequence,
    scatter_last,
)


def per_rank(total: int, size: int, what: str, chunks: int = 1) -> int:
    """`total / size`, or a ConfigError naming `what` when the degree does not divide it."""
    if total % (chunks * size):
        parts = f" in {chunks} fused parts" if chunks > 1 else ""
        raise ConfigError(f"tp={size} does not divide the {total // chunks} {what}{parts}: "
                          f"choose a tensor-parallel degree that divides {total // chunks}")
    return total // size


def _uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default initialization, with the fan-in of the whole layer."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(tensor, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """`y = x A^T + b` with the output features of A and b split across `group`.

    Args:
        in_features, out_features: the sizes of the whole layer.
        bias: add a (split) bias.
        gather_output: return the whole output (all-gather) instead of this rank's block.
        group: the tensor-parallel group (e.g. `mesh.group("tp")`); default the world.
        chunks: the output is `chunks` fused parts (3 for attention's QKV); each part is
            split on its own so every rank gets whole heads of Q, K and V.
        algorithm: the dtrain.comm algorithm for this layer's collectives.
        sequence_gather: the input is this rank's part of the sequence (sequence
            parallelism): gather it whole with this SequenceGather, which the layers reading
            the same input share, instead of copying it to the group. Only the part is
            kept for backward, which gathers it again for the weight gradient (inside a
            recomputed module the whole is kept, as it is made again anyway).

    Raises:
        ConfigError: the group size does not divide the output features (of each part).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group: comm.GroupLike = None, chunks: int = 1,
                 algorithm: str = "auto", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None,
                 sequence_gather: SequenceGather | None = None) -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_gather = sequence_gather
        local = per_rank(out_features, self.group.size, "output features", chunks)
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        self.splits = {"weight": Split(0, chunks), "bias": Split(0, chunks)}
        self.matmul: Matmul = F.linear  # x A^T (+ b) of this rank's block (FP8: float8)
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_gather is None:
            whole = copy_to_group(x, self.group, self.algorithm)
            y = self.matmul(whole, self.weight, self.bias)
        else:
            whole, again = self.sequence_gather.gathered(x)
            if again is None or recomputed_within(self):
                # no backward, or the kept part is made again anyway
                y = self.matmul(whole, self.weight, self.bias)
            elif self.matmul is F.linear:  # keep this rank's part for backward, not the whole
                y = gathered_linear(x, whole, self.weight, self.bias, again)
            else:  # FP8's product saves its input: the part in its place
                y = matmul_keeping_part(x, whole, self.weight, self.bias, again, self.matmul)
        y = self.added(whole, y)
        if not self.gather_output:
            return y
        y = gather_last(y, self.group, self.algorithm)  # [part 0, part 1, ..] of rank 0, ..
        chunks = self.splits["weight"].chunks
        if chunks > 1:  # back to [rank 0, rank 1, ..] of part 0, ..
            y = y.unflatten(-1, (self.group.size, chunks, -1)).transpose(-3, -2).flatten(-3)
        return y

    def added(self, whole: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this rank's block of the output) plus what a subclass adds from the whole
        input (a LoRA adapter, dtrain.tensor_parallel.adapted); `y` itself here."""
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[0]} here), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_gather is not None}")


class RowParallelLinear(nn.Module):
    """`y = x A^T + b` with the input features of A split across `group`.

    Each rank multiplies its block of the input by its block of A; the partial products are
    summed with one all-reduce, and the bias (replicated) is added once, after the sum.

    Args:
        in_features, out_features: the sizes of the whole layer.
        bias: add a bias (the same on every rank).
        input_is_parallel: the input is already this rank's block (the output of a
            ColumnParallelLinear); if False the whole input is given and split here.
        group, algorithm: as for ColumnParallelLinear.
        sequence_parallel: return this rank's part of the sequence (dimension 1) of the
            sum (reduce-scatter) instead of all of it (all-reduce); the bias is added to
            the part, so its gradient is this part's (summed over the group by
            dtrain.tensor_parallel.sequence).

    Raises:
        ConfigError: the group size does not divide the input features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, group: comm.GroupLike = None,
                 algorithm: str = "auto", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence_gather: SequenceGather | None = None
        """Set by apply_sequence_parallel: the gather of the column-parallel layers before
        this one, whose input its backward all-gather brings back whole too."""
        local = per_rank(in_features, self.group.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias
                     else None)
        self.splits = {"weight": Split(1)}
        self.matmul: Matmul = F.linear  # x A^T of this rank's block (FP8: float8)
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_last(x, self.group, self.algorithm)
        y = self.matmul(x, self.weight)
        if self.sequence_parallel:
            partner = self.sequence_gather.partner() if self.sequence_gather else None
            y = reduce_scatter_sequence(y, self.group, self.algorithm, partner)
        else:
            y = reduce_from_group(y, self.group, self.algorithm)
        return self.added(x, y + self.bias if self.bias is not None else y)

    def added(self, part: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the summed output, or this rank's part of the sequence of it) plus what a
        subclass adds from this rank's block of the input `part` (a LoRA adapter,
        dtrain.tensor_parallel.adapted); `y` itself here."""
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.weight.shape[1]} here), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
                f", sequence_parallel={self.sequence_parallel}")


class SharedAcrossGroup(nn.Module):
    """An activation computed whole on every rank by a replicated layer and read by every
    rank's split layers without a column-parallel layer between (latent attention's rotary
    key part, which all heads share): identity forward, its gradient (this rank's heads'
    part) summed over `group` backward, Megatron's `f`; under sequence parallelism
    (`sequence_parallel`, set by dtrain.tensor_parallel.sequence) the input is this rank's
    part of the sequence, gathered whole (the gradient summed and cut back to the part)."""

    def __init__(self, group: comm.GroupLike = None, algorithm: str = "auto",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_sequence(x, self.group, self.algorithm)
        return copy_to_group(x, self.group, self.algorithm)

    def extra_repr(self) -> str:
        return f"tp={self.group.size}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across `group`.

    Rank r holds rows [r*V/n, (r+1)*V/n). Each rank looks up the ids in its range, writes
    zeros for the others, and one all-reduce sums the lookups: every id is found on exactly
    one rank, so the sum is the whole table's lookup. `padding_idx`, as in nn.Embedding:
    that row gets no gradient (on the rank that holds it).

    Raises:
        ConfigError: the group size does not divide the vocabulary.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 group: comm.GroupLike = None, algorithm: str = "auto",
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.algorithm = comm.resolve(group), algorithm
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = per_rank(num_embeddings, self.group.size, "vocabulary entries")
        self.first = self.group.rank * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        self.splits = {"weight": Split(0)}
        self.padding_idx = padding_idx
        here = padding_idx is not None and self.first <= padding_idx < self.first + local
        self.local_padding_idx = (padding_idx - self.first if here and padding_idx is not None
                                  else None)
        nn.init.normal_(self.weight)
        if here:
            with torch.no_grad():
                self.weight[self.local_padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight, self.local_padding_idx)
        outside = (ids < self.first) | (ids >= self.first + self.weight.shape[0])
        rows = F.embedding((ids - self.first).masked_fill(outside, 0), self.weight,
                           self.local_padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(rows, self.group, self.algorithm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}; rows {self.first}.."
                f"{self.first + self.weight.shape[0] - 1} here")
