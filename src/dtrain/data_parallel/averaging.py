"""Averaging over live replicas that may change: the hook by which DataParallel and ZeRO average
gradients over something other than a fixed group.

A fixed group's all-reduce is what DataParallel and ZeRO do themselves. Fault tolerance's
live replicas (dtrain.ft.live) average over whichever replicas are alive at each step: a
reduction that fails is redone over the survivors, and a live replica dropped from the step
does not count it. They hand the strategy an `Averaging`, and the strategy knows nothing
more of them than this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dtrain.comm.group import Handle


def _nothing() -> None:
    """Nothing to do once a replacement's tensors are in (a module's own tensors)."""


@dataclass(frozen=True)
class Carried:
    """What a strategy's model state is, for a joining live replica to be sent it.

    Attributes:
        tensors: the tensors that hold the state, in an order every replica derives alike
            (written in place on the joiner); a module's parameters and buffers, or ZeRO's
            master shards (fp32 under mixed precision, this rank's shard at stage 3, where
            the parameters are gathered only to compute) and the loss scaler's state.
        trained: those a digest of the weights compares across the replicas (what trains).
        loaded: run on the joiner once `tensors` are in (ZeRO rebuilds its parameters from
            the masters, and takes the loss scale back).
    """

    tensors: Callable[[], list[torch.Tensor]]
    trained: Callable[[], list[torch.Tensor]]
    loaded: Callable[[], None] = _nothing

    @classmethod
    def of(cls, module: nn.Module) -> Carried:
        """A module's own state: its parameters and buffers, in registration order."""
        return cls(lambda: [t.data for t in (*module.parameters(), *module.buffers())],
                   lambda: [p.data for p in module.parameters() if p.requires_grad])


class Averaging(Protocol):
    """Sums a step's gradient buffers across the live replicas taking part in it."""

    def attach(self, carried: Carried, optimizer: torch.optim.Optimizer | None) -> None:
        """What the strategy holds (its model state, and the optimizer it owns, if any),
        for an averaging that must hand a joining live replica the same state."""

    def start(self, buffer: torch.Tensor) -> Handle:
        """Begin summing `buffer` (this live replica's, left untouched) across the live replicas;
        called as each buffer is complete, possibly while backward runs."""

    def finish(self, started: list[Handle], buffers: list[torch.Tensor]) -> int:
        """Wait for the sums `started` (of `buffers`, in order) and write them into
        `buffers`; returns how many live replicas they summed (the strategy divides), or 0 when
        this step does not count for this live replica (its buffers are left as they were)."""
