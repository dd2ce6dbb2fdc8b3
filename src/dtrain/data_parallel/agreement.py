"""Ranks whose copies of the model start identical: the same model checked on every rank,
state broadcast."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import nn

from dtrain import comm
from dtrain.errors import DtrainError


def agreement_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where a small tensor that ranks agree on goes: the device of the tensors it is about
    (NCCL carries only CUDA tensors), the CPU for tensors that have none (meta)."""
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def check_same_model(params: Sequence[torch.Tensor], group: comm.Group, who: str,
                     algorithm: str = "auto") -> None:
    """Fail with the first disagreeing rank if ranks' models differ in parameter count or shapes."""
    shapes = ";".join(f"{tuple(p.shape)}{p.dtype}" for p in params)
    signature = torch.tensor(
        [len(params), sum(p.numel() for p in params), zlib.crc32(shapes.encode())],
        dtype=torch.int64, device=agreement_device(params),
    )
    everyone = comm.all_gather(signature.view(1, -1), group=group, algorithm=algorithm)
    for group_rank, other in enumerate(everyone):
        if not torch.equal(other, everyone[0]):
            rank, first = group.global_rank(group_rank), group.global_rank(0)
            raise DtrainError(
                f"{who}: rank {rank} has a different model than rank {first} "
                f"({other[0]} parameters / {other[1]} elements vs {everyone[0][0]} / "
                f"{everyone[0][1]}, or different shapes): build the same model on every rank"
            )


@torch.no_grad()
def broadcast_state(module: nn.Module, group: comm.Group, algorithm: str = "auto",
                    skip: frozenset[int] = frozenset()) -> None:
    """Copy the group's first rank's parameters and buffers into every rank's module
    (not those without values: on the meta device, a model built in split form; released,
    ZeRO-3's parameters between forwards, which it gathers from its shards; nor those
    whose id is in `skip`)."""
    broadcast_tensors([t for t in [*module.parameters(), *module.buffers()]
                       if id(t) not in skip], group, algorithm)


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: comm.GroupLike,
                      algorithm: str = "auto") -> None:
    """Copy the group's first rank's `tensors` into every rank's (those without values
    left alone: meta, or released)."""
    for tensor in tensors:
        if not _valueless(tensor):
            comm.broadcast(tensor.data, src=0, group=group, algorithm=algorithm)


def _valueless(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has no values to send: on the meta device, or its storage released
    (resized to nothing, as ZeRO-3 does to a parameter between forwards)."""
    return tensor.is_meta or (tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0)
