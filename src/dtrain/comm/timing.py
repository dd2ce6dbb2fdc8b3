"""Timing collectives fairly on a busy machine: the same method for `auto`'s cost model and
for `dtrain bench comm`, so the two agree on what "fastest" means.

The candidates take turns: in each round every candidate makes its calls back to back after
a barrier, so a slow moment of the machine hurts all of them alike. A round gives a mean
time per call (slow calls inside it included, as a training run pays them); the median
over rounds keeps a stall of the machine, one round many times slower than the rest, out
of the figure. Each figure is the slowest rank's (a rank that only sends can finish before
its peer has the data), agreed by an allreduce, so every rank holds the same numbers.

The method is in dtrain.comm.cost (auto measures with it from inside the collectives);
here it is bound to dtrain.comm.collectives' barrier and allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtrain.comm import collectives, cost
from dtrain.comm.cost import synchronizer
from dtrain.comm.group import Group

__all__ = ["slowest", "synchronizer", "time_turns"]


def time_turns(calls: dict[str, Callable[[], Any]], counts: dict[str, int], rounds: int,
               group: Group, device: torch.device | str = "cpu") -> dict[str, float]:
    """Seconds per call of each of `calls`: `counts[name]` calls in all, split over `rounds`.

    A collective call: every rank of `group` must make it with the same counts.
    """
    return cost.time_turns(calls, counts, rounds, group, device, collectives)


def slowest(seconds: list[float], group: Group, device: torch.device | str = "cpu") -> list[float]:
    """Each of `seconds`, replaced by its largest value over the ranks of `group`."""
    return cost.slowest(seconds, group, device, collectives)
