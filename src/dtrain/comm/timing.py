"""Timing collectives fairly on a busy machine: the same method for `auto`'s cost model and
for `dtrain bench comm`, so the two agree on what "fastest" means.

The candidates take turns: in each round every candidate makes its calls back to back after
a barrier, so a slow moment of the machine hurts all of them alike. A round gives a mean
time per call (slow calls inside it included, as a training run pays them); the median
over rounds keeps a stall of the machine, one round many times slower than the rest, out
of the figure. Each figure is the slowest rank's (a rank that only sends can finish before
its peer has the data), agreed by an allreduce, so every rank holds the same numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.comm.group import Group


def time_turns(calls: dict[str, Callable[[], Any]], counts: dict[str, int], rounds: int,
               group: Group, device: torch.device | str = "cpu") -> dict[str, float]:
    """Seconds per call of each of `calls`: `counts[name]` calls in all, split over `rounds`.

    A collective call: every rank of `group` must make it with the same counts.
    """
    from dtrain.comm import collectives

    sync = synchronizer(device)
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(rounds):
        for name, call in calls.items():
            turn = counts[name] // rounds + (i < counts[name] % rounds)
            if turn == 0:
                continue
            collectives.barrier(group=group)
            start = time.perf_counter()
            for _ in range(turn):
                call()
            sync()
            per_call[name].append((time.perf_counter() - start) / turn)
    return dict(zip(calls, slowest([statistics.median(per_call[name]) for name in calls],
                                   group, device), strict=True))


def slowest(seconds: list[float], group: Group, device: torch.device | str = "cpu") -> list[float]:
    """Each of `seconds`, replaced by its largest value over the ranks of `group`."""
    from dtrain.comm import collectives

    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    collectives.all_reduce(values, op="max", group=group, algorithm="native")
    return values.tolist()


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for the work queued on `device` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
