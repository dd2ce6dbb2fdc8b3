"""Names of the collectives and their algorithms, reduction operators, flat sharding, and
the check that a tensor still holds its memory.

A tensor is treated as its flattened elements. When its length does not divide by the
group size, the first `numel % size` shards are one element longer (as in MPI's block
distribution); `shard_sizes` and `shard_offsets` say exactly where each shard lies.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import torch
import torch.distributed as dist

ALGORITHMS = ("native", "ring", "tree", "halving_doubling")

# The algorithms each collective has (dtrain.comm.collectives implements them).
AVAILABLE: dict[str, tuple[str, ...]] = {
    "all_reduce": ALGORITHMS,
    "broadcast": ("native", "tree"),
    "reduce": ("native", "tree"),
    "all_gather": ("native", "ring"),
    "reduce_scatter": ("native", "ring"),
    "scatter": ("native",),
    "gather": ("native",),
    "all_to_all": ("native", "pairwise"),
    "barrier": ("native",),
}


def bus_factor(op: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the whole buffer, with a bandwidth-optimal algorithm
    (nccl-tests' busbw / algbw): 2(n-1)/n for all_reduce, (n-1)/n where the buffer is split
    into one piece per rank, 1 for broadcast and reduce."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter", "scatter", "gather", "all_to_all"):
        return (ranks - 1) / ranks
    if op == "barrier":
        return 0.0
    return 1.0


_Named = TypeVar("_Named", bound=enum.Enum)


def parse_named(cls: type[_Named], value: _Named | str, what: str) -> _Named:
    """The member of the string enum `cls` that `value` names (any case), or `value` itself.

    Raises:
        ValueError: an unknown name, the message naming `what` and the known names.
    """
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        names = ", ".join(str(member.value) for member in cls)
        raise ValueError(f"unknown {what} {value!r}: use one of {names}") from None


class ReduceOp(enum.Enum):
    """How values from different ranks combine."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        return parse_named(cls, op, "reduce op")

    def to_torch(self) -> dist.ReduceOp.RedOpType:
        """The torch op; AVG maps to SUM (dtrain divides itself, gloo has no AVG)."""
        return {
            ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT,
        }[self]


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc <- acc (op) other, in place. AVG sums; `finish_` divides at the end."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(other)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    else:
        acc.mul_(other)


def finish_(tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
    """Turn a sum into an average for AVG (integer tensors: truncating division)."""
    if op is ReduceOp.AVG:
        if tensor.is_floating_point():
            tensor.div_(size)
        else:
            tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


def shard_sizes(numel: int, parts: int) -> list[int]:
    """Lengths of `parts` contiguous shards of `numel` elements, the longer ones first."""
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_offsets(numel: int, parts: int) -> list[int]:
    """Start offset of each shard (plus the end, so shard i is [off[i], off[i+1]))."""
    offsets = [0]
    for n in shard_sizes(numel, parts):
        offsets.append(offsets[-1] + n)
    return offsets


def same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of the same memory from the same element on (an
    all-gather in place). Asked of the views, not their data pointers, so that it also
    answers for tensors without memory: the meta and fake tensors the planner traces."""
    alias = torch._C._is_alias_of(a, b)  # type: ignore[attr-defined]  # not in torch's stubs
    return alias and a.storage_offset() == b.storage_offset()


def shards(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Views of `flat` as `parts` contiguous shards."""
    off = shard_offsets(flat.numel(), parts)
    return [flat[off[i] : off[i + 1]] for i in range(parts)]


def check_held(tensor: torch.Tensor, what: str) -> None:
    """Refuse `tensor` for `what` when its storage holds fewer bytes than its shape and
    strides reach (a released storage: see the module docstring).

    Raises:
        ValueError: it does, with its shape and the likely cause.
    """
    if tensor.numel() == 0:
        return
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape,
                                                                      tensor.stride(),
                                                                      strict=True))
    if tensor.untyped_storage().nbytes() < (last + 1) * tensor.element_size():
        raise ValueError(f"{what}: a tensor of shape {tuple(tensor.shape)} whose memory was "
                         "released (a ZeRO-3 parameter outside its unit's forward and "
                         "backward? read the weights with ZeRO.state_dict())")
