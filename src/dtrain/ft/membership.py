"""Who takes part in a training step: the one question fault tolerance answers for the
training loop, which asks it the same way whatever the answer's source.

A job's data-parallel replicas are either fixed (every rank of every replica, each step:
`Fixed`) or live (dtrain.ft.live.job.LiveMembership: a replica that dies is dropped within
the step, a replacement joins at the next one and may start at its peers' step, and a
replica dropped from a step does not apply it). The training loop (dtrain.train) drives a
`Membership` and never asks which kind it has.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dtrain.errors import DtrainError
from dtrain.parallel.averaging import Averaging


class RunOver(DtrainError):
    """The run finished without this replica while it waited to (re)join: it has left, and
    has nothing left to do."""


class Membership(Protocol):
    """The replicas of a job, step by step, as the training loop sees them.

    Attributes:
        replicas, replica: how many replicas the global batch is split over, and this
            replica's place among them (its slice of every batch).
        averaging: how DataParallel and ZeRO average gradients across the replicas when
            it is not the mesh's fixed group (None: the mesh's).
        first: whether this replica is the one whose rank 0 prints and records the run.
        joined_late: whether this process joined a run already under way (its metrics
            append to what the others wrote).
    """

    replicas: int
    replica: int
    averaging: Averaging | None
    first: bool
    joined_late: bool

    def track(self, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """What a joining replica must be sent besides the model (its optimizer's state and
        the learning-rate schedule)."""

    def describe(self, ranks: str, world_size: int) -> str:
        """The banner's words for the job's ranks (`ranks`: this replica's, described)."""

    def begin_step(self, step: int) -> int:
        """Start `step`; returns the step this replica is at (a joiner: its peers').

        Raises:
            RunOver: the run finished while this replica waited to join.
        """

    def applies_step(self) -> bool:
        """Whether this replica applies the step it just averaged (False: it was dropped
        from it, and is sent the state anew)."""

    def writes(self) -> bool:
        """Whether this replica records this step's metrics and writes its checkpoints."""

    def step_metrics(self) -> dict[str, int]:
        """What the metrics of a step add about who took part."""

    def finish(self) -> None:
        """The run is over for this replica: leave (the others finish without waiting)."""


class Fixed:
    """Every replica takes part in every step: `replicas` of them, this one `replica`."""

    averaging: Averaging | None = None
    first = True
    joined_late = False

    def __init__(self, replicas: int = 1, replica: int = 0) -> None:
        self.replicas, self.replica = replicas, replica

    def track(self, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        return None

    def describe(self, ranks: str, world_size: int) -> str:
        return ranks

    def begin_step(self, step: int) -> int:
        return step

    def applies_step(self) -> bool:
        return True

    def writes(self) -> bool:
        return True

    def step_metrics(self) -> dict[str, int]:
        return {}

    def finish(self) -> None:
        return None
