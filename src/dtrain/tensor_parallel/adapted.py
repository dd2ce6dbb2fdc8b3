"""LoRA adapters split with their tensor-parallel layers (dtrain.adapters.lora).

An adapted layer computes W x + b + B A x * alpha / rank. Split over a tensor-parallel
group, its adapter is cut so that each rank adds exactly its part of B A x, with no
collective of its own beside the layer's where none is needed:

| layer           | W split by     | A (rank x in)       | B (out x rank)       | added         |
|-----------------|----------------|---------------------|----------------------|---------------|
| column-parallel | output rows    | whole on every rank | split by the same    | B_r A x to    |
|                 | (fused parts)  |                     | rows (and parts)     | its block     |
| row-parallel    | input columns  | split by the same   | whole on every rank  | B (sum_r A_r  |
|                 |                | columns             |                      | x_r), once    |

Column-parallel: a rank's rows of B A x are B_r (A x), from the whole input the layer
already has (copied to the group, or gathered from the sequence parts). A's gradient on a
rank comes through B_r only, so it is summed over the group as backward reaches it (as a
headwise module's is: dtrain.tensor_parallel.summed.SumOverGroup).

Row-parallel: A_r x_r, summed over the group, is A x: rank numbers per token, all-reduced
(or reduce-scattered into sequence parts under sequence parallelism, as the layer's own
output is); B then adds B (A x) after the layer's sum, once. Under sequence parallelism
B sees this rank's part of the sequence only: its gradient is summed over the group with
the other replicated parameters' at the end of backward (dtrain.tensor_parallel.sequence).

Names stay the plain model's (`...q_proj.lora_A.weight`); a split factor carries its
`splits` and `group`, so checkpoints, the whole state and clipping see the whole tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain import comm
from dtrain.adapters.lora import LoRAFactor, LoRALinear, adapted
from dtrain.split import Split
from dtrain.tensor_parallel.functions import reduce_from_group, reduce_scatter_sequence
from dtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dtrain.tensor_parallel.summed import SumOverGroup


class _Adapter(nn.Module):
    """What both split adapted layers hold beside their base (set by `split_adapter`)."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    lora_dropout: nn.Module
    scaling: float
    active: bool = True
    """False inside dtrain.adapters.lora.disabled: the base alone."""


class ColumnParallelLoRA(ColumnParallelLinear, _Adapter):
    """A column-parallel layer with its adapter: A whole, B split with the output rows."""

    def added(self, whole: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return y
        return y + adapted(self, whole)


class RowParallelLoRA(RowParallelLinear, _Adapter):
    """A row-parallel layer with its adapter: A split with the input columns, B whole."""

    def added(self, part: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return y
        down = self.lora_A(self.lora_dropout(part))
        if self.sequence_parallel:
            down = reduce_scatter_sequence(down, self.group, self.algorithm)
        else:
            down = reduce_from_group(down, self.group, self.algorithm)
        return y + self.lora_B(down) * self.scaling


def _factor(whole: LoRAFactor, fan_in: int, fan_out: int, split: Split | None,
            group: comm.Group) -> LoRAFactor:
    """A factor of this rank's shape, drawn by `whole`'s rule; `split`: how it is cut."""
    factor = LoRAFactor.drawn(fan_in, fan_out, whole.rule, whole.weight.device,
                              whole.weight.dtype)
    if split is not None:
        factor.splits = {"weight": split}  # type: ignore[assignment]  # read by placements
        factor.group = group  # type: ignore[assignment]
    return factor


def split_adapter(new: nn.Module, old: LoRALinear, group: comm.Group,
                  algorithm: str) -> nn.Module:
    """`new` (the split layer parallelize built in place of `old`) with `old`'s adapter cut
    as the module doc says; its parameters are this rank's shapes, filled by parallelize
    from `old`'s by their `splits`."""
    rank = old.lora_A.out_features
    if isinstance(new, ColumnParallelLinear):
        new.__class__ = ColumnParallelLoRA
        chunks = new.splits["weight"].chunks
        new.lora_A = _factor(old.lora_A, new.in_features, rank, None, group)
        new.lora_B = _factor(old.lora_B, rank, new.weight.shape[0], Split(0, chunks), group)
        if group.size > 1:  # its gradient comes through this rank's rows of B only
            new.lora_A.headwise = SumOverGroup(group, algorithm)  # type: ignore[assignment]
    elif isinstance(new, RowParallelLinear):
        new.__class__ = RowParallelLoRA
        new.lora_A = _factor(old.lora_A, new.weight.shape[1], rank, Split(1), group)
        new.lora_B = _factor(old.lora_B, rank, new.out_features, None, group)
    else:
        return new
    adapted: ColumnParallelLoRA | RowParallelLoRA = new  # type: ignore[assignment]
    adapted.lora_dropout = old.lora_dropout
    adapted.scaling = old.scaling
    return adapted
