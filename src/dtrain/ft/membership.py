"""Who takes part in a training step: the one question fault tolerance answers for the
training loop, which asks it the same way whatever the answer's source.

The copies of the model that train together are either fixed (every rank of every sync
group, each step: `Fixed`) or live replicas (dtrain.ft.live.job.LiveMembership: a live
replica that dies is dropped within the step, a replacement joins at the next one and may
start at its peers' step, and a live replica dropped from a step does not apply it). The
training loop (dtrain.train) drives a `Membership` and never asks which kind it has.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dtrain.data_parallel.averaging import Averaging
from dtrain.errors import DtrainError


class RunOver(DtrainError):
    """The run finished without this live replica while it waited to (re)join: it has left, and
    has nothing left to do."""


class Membership(Protocol):
    """The copies of the model in a job, step by step, as the training loop sees them.

    Attributes:
        copies, copy: how many copies of the model train together on slices of the global
            batch (sync groups, or live replicas), and this one's place among them (its
            slice of every batch).
        averaging: how DataParallel and ZeRO average gradients across the copies when
            it is not the mesh's fixed group (None: the mesh's).
        first: whether this copy is the one whose rank 0 prints and records the run.
        joined_late: whether this process joined a run already under way (its metrics
            append to what the others wrote).
        worlds: how many worlds (process groups of their own, each laid out by the mesh)
            the copies make: 1 when they are all in this one (sync groups), `copies` when
            each is a world (live replicas). The ranks in the job: the world size times it.
        steady: whether the same ranks take part in every step, so that the world's ranks
            may meet after one (to gather their speed, to generate text in split form);
            False for live replicas, whose worlds may be torn down between steps.
    """

    copies: int
    copy: int
    worlds: int
    steady: bool
    averaging: Averaging | None
    first: bool
    joined_late: bool

    def track(self, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """What a joining live replica must be sent besides the model (its optimizer's state and
        the learning-rate schedule)."""

    def describe(self, ranks: str, world_size: int) -> str:
        """The banner's words for the job's ranks (`ranks`: this copy's, described)."""

    def begin_step(self, step: int) -> int:
        """Start `step`; returns the step this copy is at (a joiner: its peers').

        Raises:
            RunOver: the run finished while this live replica waited to join.
        """

    def applies_step(self) -> bool:
        """Whether this copy applies the step it just averaged (False: it was dropped
        from it, and is sent the state anew)."""

    def writes(self) -> bool:
        """Whether this copy records this step's metrics and writes its checkpoints."""

    def took_over(self) -> bool:
        """Whether this copy writes the step in place of the previous step's writer, gone
        since (a live replica killed, perhaps, after that step was applied and before its
        record was written): the loop then records that step too, if the record lacks it."""

    def step_metrics(self) -> dict[str, int]:
        """What the metrics of a step add about who took part."""

    def compare(self) -> dict[str, int]:
        """After a step, at a checkpoint (a call every copy makes): whether the copies that
        must hold the same weights do (live replicas: their digests compared, a difference
        said in a warning); what the step's metrics add."""

    def finish(self) -> None:
        """The run is over for this copy: leave (the others finish without waiting)."""


class Fixed:
    """Every copy of the model takes part in every step: `copies` of them (the sync
    groups), this one `copy`."""

    averaging: Averaging | None = None
    first = True
    joined_late = False
    worlds = 1
    steady = True

    def __init__(self, copies: int = 1, copy: int = 0) -> None:
        self.copies, self.copy = copies, copy

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

    def took_over(self) -> bool:
        return False

    def step_metrics(self) -> dict[str, int]:
        return {}

    def compare(self) -> dict[str, int]:
        return {}  # sync groups differ between synchronizations by design

    def finish(self) -> None:
        return None
