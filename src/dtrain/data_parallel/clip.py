"""One global gradient-norm clip for every layout.

A rank holds gradients in four ways, and each way says over which mesh axes its squares
must be summed to count every element of the whole model's gradient exactly once:

- replicated (DataParallel after its all-reduce, a tensor that tp copies on every rank):
  summed over no axis, every rank already has the same values;
- split by tensor parallelism (a column- or row-parallel block): summed over "tp";
- sharded over data parallelism (a ZeRO shard): summed over "dp";
- split by expert parallelism (each rank holds other experts of a MoE layer): summed over
  "ep".

A ZeRO shard of a tensor-parallel block is summed over both. Pipeline stages hold
different layers, so every total is finally summed over "pp"; a tied weight held by two
stages is scaled on both but counted on one (`counted=False` on the other).

    parts = [GradPart(p.grad, over=("tp",)) for p in split] + [GradPart(g) for g in ...]
    norm = clip_grad_norm_(parts, max_norm=1.0, groups={"dp": dp, "tp": tp, "pp": pp})

Every rank runs the same all-reduces (dp, tp, ep, pp; a group not given is skipped), so
the collective sequence never depends on what a rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import comm

AXES = ("dp", "tp", "ep")  # the axes a part may be summed over before the final sum over pp


@dataclass(frozen=True)
class GradPart:
    """A gradient tensor this rank holds, and how it counts toward the global norm.

    Args:
        grad: the gradient (scaled in place by the clip).
        over: the axes ("dp", "tp", "ep") over which this tensor's squares are summed.
        counted: False for a copy another rank counts (a tied weight's second holder).
    """

    grad: torch.Tensor
    over: tuple[str, ...] = ()
    counted: bool = True


def _slot(over: tuple[str, ...]) -> int:
    """Index of the axis set in the sums vector: bit 0 = dp, bit 1 = tp, bit 2 = ep."""
    unknown = set(over) - set(AXES)
    if unknown:
        raise ValueError(f"GradPart.over: unknown axes {sorted(unknown)}; use {AXES}")
    return sum(1 << i for i, axis in enumerate(AXES) if axis in over)


@torch.no_grad()
def global_grad_norm(parts: Iterable[GradPart], groups: Mapping[str, Any],
                     device: torch.device | None = None) -> float:
    """The 2-norm of the whole model's gradient from every rank's parts (collective over
    the dp, tp, ep and pp groups given; a missing axis counts as a group of one)."""
    parts = list(parts)
    if device is None:
        device = parts[0].grad.device if parts else torch.device("cpu")
    sums = torch.zeros(1 << len(AXES), dtype=torch.float64, device=device)
    for part in parts:
        if part.counted:
            sums[_slot(part.over)] += part.grad.detach().double().pow(2).sum()
    for bit, axis in enumerate(AXES):
        group = groups.get(axis)
        if group is None:
            continue
        which = [i for i in range(len(sums)) if i >> bit & 1]
        reduced = comm.all_reduce(sums[which].clone(), group=group)
        sums[which] = reduced
    total = sums.sum().view(1)
    if groups.get("pp") is not None:
        comm.all_reduce(total, group=groups["pp"])
    return total.sqrt().item()


@torch.no_grad()
def clip_grad_norm_(parts: Iterable[GradPart], max_norm: float, groups: Mapping[str, Any],
                    device: torch.device | None = None) -> float:
    """Scale every part so that the whole model's gradient norm is at most `max_norm`;
    returns the norm before clipping (collective, see `global_grad_norm`).

    Raises:
        ValueError: a part names an axis other than "dp", "tp" or "ep".
    """
    parts = list(parts)
    norm = global_grad_norm(parts, groups, device)
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        for part in parts:
            part.grad.mul_(scale)
    return norm
