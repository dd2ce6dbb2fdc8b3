"""Dropout masks of each tensor-parallel rank's own: Megatron-LM's model-parallel RNG.

Every rank of a tensor-parallel group starts from the same seed, so the random numbers it
draws are the same as its peers': right where the ranks hold the same activations (the
input part, before sequence parallelism cuts the sequence), where equal masks keep the
replicas equal. Where each rank holds something of its own, its own part of the sequence
(after a row-parallel layer's reduce-scatter) or its own heads and features (between the
split layers), equal draws would repeat one mask across the parts: token t of rank 0 and
token t of rank 1 dropped together. Megatron-LM draws those masks from a second generator
seeded per tensor-parallel rank (its `CudaRNGStatesTracker`); `RankRNG.fork` does the
same around such a dropout.

The per-rank seed is drawn from the default generator at each use (the same draw on every
rank of the group) and combined with the rank: a run is reproducible from its seed alone,
and activation checkpointing, which restores the default generator before recomputing,
replays the same masks (torch.utils.checkpoint restores the CPU generator and the
device's; dtrain.models.recompute relies on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dtrain import comm
from dtrain.graph_break import graph_break
from dtrain.models.stages import AttentionCore

_SEEDS = 2**48  # seeds drawn below this, times the group size plus the rank: below 2**63


class RankRNG:
    """The random numbers of this rank of a tensor-parallel `group`, for dropout on what
    the rank holds alone (Megatron's model-parallel RNG)."""

    def __init__(self, group: comm.Group) -> None:
        self.rank, self.size = group.rank, group.size

    @contextlib.contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        """Inside: the CPU generator and `device`'s seeded for this rank alone, from one
        draw of the default CPU generator (the same on every rank of the group); after:
        both as they were, but for that draw."""
        seed = int(torch.randint(_SEEDS, (1,)).item()) * self.size + self.rank
        accelerated = device.type != "cpu"
        devices = [device.index if device.index is not None else
                   torch.get_device_module(device.type).current_device()] if accelerated else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if accelerated
                                   else "cuda"):
            torch.default_generator.manual_seed(seed)
            if accelerated:
                with torch.get_device_module(device.type).device(devices[0]):
                    torch.get_device_module(device.type).manual_seed(seed)
            yield

    def __call__(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return self.fork(device)


class RankDropout(nn.Dropout):
    """nn.Dropout drawing its mask from this rank's RankRNG (same probability, no state)."""

    def __init__(self, p: float, inplace: bool, rng: RankRNG) -> None:
        super().__init__(p, inplace)
        self.rng = rng

    @graph_break
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return super().forward(x)
        with self.rng.fork(x.device):
            return super().forward(x)


def fork_dropouts(parts: list[nn.Module], rng: RankRNG) -> int:
    """Make the dropouts in `parts` draw this rank's masks: each nn.Dropout becomes a
    RankDropout, and each AttentionCore (dropout on attention probabilities) gets `rng`.
    Returns how many were changed."""
    changed = 0
    for part in parts:
        for name, module in list(part.named_modules()):
            if type(module) is nn.Dropout:
                parent, _, child = name.rpartition(".")
                setattr(part.get_submodule(parent) if parent else part, child,
                        RankDropout(module.p, module.inplace, rng))
                changed += 1
            elif isinstance(module, AttentionCore):
                module.rng = rng
                changed += 1
    return changed
