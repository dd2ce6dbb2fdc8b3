"""Which algorithm `algorithm="auto"` picks, and why; measuring ahead of time.

`explain(op, nbytes, group)` says which algorithm a call would use and why. `measure`
times every candidate of an operation on a group (`dtrain bench comm --calibrate` saves the
curves with `save_models`). The cost model itself, and the choice every collective makes
with it, live in dtrain.comm.cost (below dtrain.comm.collectives, whose calls it times);
here they are bound to those calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtrain.comm import collectives, cost
from dtrain.comm.cost import PROBE_BYTES, Curve, cache_key, calibration_path, save_models
from dtrain.comm.group import Group
from dtrain.comm.ops import AVAILABLE
from dtrain.comm.registry import resolve

__all__ = ["PROBE_BYTES", "AlgorithmChoice", "Curve", "cache_key", "calibration_path",
           "explain", "measure", "save_models"]


@dataclass(frozen=True)
class AlgorithmChoice:
    """What `explain` reports: the algorithm chosen and the predictions behind it."""

    op: str
    nbytes: int
    algorithm: str
    predicted_us: dict[str, float]
    reason: str


def measure(g: Group, op: str, candidates: tuple[str, ...],
            device: torch.device | str = "cpu") -> dict[str, Curve]:
    """Time every candidate of `op` on `g` at every probe size (a collective call: all ranks
    must make it)."""
    return cost.measure(g, op, candidates, device, collectives)


def explain(op: str, nbytes: int, group=None,
            device: torch.device | str = "cpu") -> AlgorithmChoice:
    """Which algorithm `algorithm="auto"` would use for `op` on `nbytes`, and why.

    A collective call the first time (it may measure): call it on every rank.
    """

    g = resolve(group)
    available = AVAILABLE[op]
    if len(available) == 1:
        return AlgorithmChoice(op, nbytes, available[0], {}, f"{op} has only the native algorithm")
    lines = cost.models(g, op, available, device, collectives, nbytes)
    predicted = {name: lines[name].predict(nbytes) * 1e6 for name in available}
    best = min(predicted, key=predicted.__getitem__)
    runner_up = sorted(predicted.values())[1]
    reason = (f"{best} predicted {predicted[best]:.0f} us for {nbytes} bytes on {g.size} ranks "
              f"({runner_up / max(predicted[best], 1e-9):.2f}x faster than the next best); "
              f"each algorithm's time was measured on this group at "
              f"{', '.join(str(b) for b, _ in lines[best].points)} bytes and interpolated")
    return AlgorithmChoice(op, nbytes, best, predicted, reason)
