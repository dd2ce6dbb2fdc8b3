"""Calibration files for tests: `auto` then picks an algorithm at once instead of timing
every candidate on every new group (seconds each)."""

from __future__ import annotations

from pathlib import Path

from dtrain.comm import AVAILABLE, select

COST = {"ring": 1.0, "native": 2.0, "tree": 3.0, "halving_doubling": 4.0, "pairwise": 5.0}
"""Relative cost of each algorithm: ring is cheapest wherever an operation has it."""


def write_calibration(path: Path, backends: tuple[str, ...] = ("gloo",),
                      sizes: tuple[int, ...] = (2,)) -> None:
    """Save cost curves (by COST) for groups of `sizes` ranks on `backends` at `path`
    (point DTRAIN_CALIBRATION at it)."""
    select.save_models({
        f"{backend}/size{n}/{op}": {name: select.Curve(((4, 1e-5 * COST[name]),
                                                        (1 << 26, 1e-1 * COST[name])))
                                    for name in names}
        for backend in backends for n in sizes
        for op, names in AVAILABLE.items() if len(names) > 1})
