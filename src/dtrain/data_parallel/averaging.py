"""Averaging over live replicas that may change: the hook by which DataParallel and ZeRO average
gradients over something other than a fixed group.

A fixed group's all-reduce is what DataParallel and ZeRO do themselves. Fault tolerance's
live replicas (dtrain.ft.live) average over whichever replicas are alive at each step: a
reduction that fails is redone over the survivors, and a live replica dropped from the step
does not count it. They hand the strategy an `Averaging`, and the strategy knows nothing
more of them than this protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dtrain.comm.group import Handle


class Averaging(Protocol):
    """Sums a step's gradient buffers across the live replicas taking part in it."""

    def attach(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """What the strategy holds (its module, and the optimizer it owns, if any), for an
        averaging that must hand a joining live replica the same state."""

    def start(self, buffer: torch.Tensor) -> Handle:
        """Begin summing `buffer` (this live replica's, left untouched) across the live replicas;
        called as each buffer is complete, possibly while backward runs."""

    def finish(self, started: list[Handle], buffers: list[torch.Tensor]) -> int:
        """Wait for the sums `started` (of `buffers`, in order) and write them into
        `buffers`; returns how many live replicas they summed (the strategy divides), or 0 when
        this step does not count for this live replica (its buffers are left as they were)."""
