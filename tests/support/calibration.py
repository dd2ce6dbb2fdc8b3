"""Calibration files for tests: `algorithm="auto"` then picks an algorithm at once instead
of timing every candidate on every new group (seconds each), and picks the one a test
expects."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.comm import AVAILABLE

RING_FIRST = {"ring": 1.0, "native": 2.0, "tree": 3.0, "halving_doubling": 4.0,
              "pairwise": 5.0}
"""Relative costs where dtrain's ring is cheapest wherever an operation has it."""
NATIVE_FIRST = {"native": 1.0, "ring": 2.0, "tree": 3.0, "halving_doubling": 4.0,
                "pairwise": 5.0}
"""Relative costs where each operation's native algorithm is the cheapest."""


def write_calibration(path: Path, backends: tuple[str, ...] = ("gloo",),
                      sizes: tuple[int, ...] | range = (2,),
                      cost: dict[str, float] = RING_FIRST) -> dict[str, str]:
    """Save cost curves (in dtrain.comm.cost's file format, each algorithm's time scaled by
    `cost`) for groups of `sizes` ranks on `backends` at `path`; returns the environment
    that points at it (DTRAIN_CALIBRATION)."""
    curves = {f"{backend}/size{n}/{op}": {name: [[4, 1e-5 * cost[name]],
                                                 [1 << 26, 1e-1 * cost[name]]]
                                          for name in names}
              for backend in backends for n in sizes
              for op, names in AVAILABLE.items() if len(names) > 1}
    path.write_text(json.dumps(curves))
    return {"DTRAIN_CALIBRATION": str(path)}
