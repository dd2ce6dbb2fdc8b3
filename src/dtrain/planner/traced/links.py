"""What a collective costs on the links: alpha (seconds per call) and beta (seconds per
byte each rank sends), per operation.

The figures come, in this order, from `--bandwidth`/`--latency` given by the user, from
the calibration file `dtrain bench comm --calibrate` writes (dtrain.comm.select: the
measured time of each algorithm at 4 KiB .. 16 MiB of each rank's input; alpha is the
fastest algorithm's time at the smallest probe, beta the slope between the two largest,
per byte of bus traffic),
or from assumed defaults, which the planner says it used.

A collective on a group of n ranks then costs `calls * alpha + bus_bytes * beta`, where
bus bytes are the buffer's bytes times the share each rank sends (2(n-1)/n for an
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for a send): the
measured figures carry over to other group sizes through that share. The axes are the
mesh's: dp (the ranks averaging gradients, or sharding them under ZeRO: dp x cp under
context parallelism, a replica's dp_shard x cp under hybrid sharding), dp_replicate (the
replicas of hybrid sharding, all-reducing each gradient shard: dtrain.planner.costs), tp,
pp, cp (the ranks splitting each sequence: the ring's sends, its methods' collectives), ep
(the ranks exchanging tokens with their experts) and edp (the dp_shard / ep ranks holding
the same experts).

Ranks on several machines (`across_machines`): the figures above are a machine's links,
and a collective whose group spans machines costs the network's alpha and beta instead (a
ring runs at its slowest link's pace). A group is the consecutive ranks of its axis and
those inside it (the mesh's order, tp innermost: a dp group spans dp_shard x cp x tp
ranks, the replicas dp x cp x tp), and stays on one machine when that span divides the
machine's ranks. Without it every rank is on one machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from dtrain.comm.collectives import PER_RANK_INPUT
from dtrain.comm.ops import bus_factor
from dtrain.errors import ConfigError
from dtrain.mesh import Dims

DEFAULT_GBPS = 10.0
DEFAULT_LATENCY_US = 20.0


@dataclass
class Links:
    """alpha and beta per operation; `default` for an operation without its own figures."""

    default: tuple[float, float]
    per_op: dict[str, tuple[float, float]] = field(default_factory=dict)
    source: str = "assumed"
    machine: int = 0
    """Ranks per machine; 0: every rank on one machine."""
    network: tuple[float, float] | None = None
    """alpha and beta between machines (`across_machines`); None: as inside one."""

    @classmethod
    def given(cls, gbps: float, latency_us: float) -> Links:
        return cls((latency_us * 1e-6, 1 / (gbps * 1e9)),
                   source=f"given: {gbps:g} GB/s per rank, {latency_us:g} us per call")

    @classmethod
    def calibrated(cls, path: str, backend: str = "gloo") -> Links | None:
        """Figures from a calibration file, or None if it has none for `backend`."""
        try:
            data = json.loads(open(path).read())
        except (OSError, ValueError):
            return None
        per_op: dict[str, tuple[int, tuple[float, float]]] = {}
        for key, curves in data.items():
            kind, size, op = (key.split("/") + ["", "", ""])[:3]
            if kind != backend or not size.startswith("size"):
                continue
            n = int(size[4:])
            if n < 2 or (op in per_op and per_op[op][0] >= n):
                continue  # the largest group measured speaks for the others
            per_op[op] = (n, _fit(op, n, curves))
        if not per_op:
            return None
        figures = {op: ab for op, (_, ab) in per_op.items()}
        default = figures.get("all_reduce", next(iter(figures.values())))
        return cls(default, figures, source=f"measured: {path} ({backend})")

    def across_machines(self, ranks: int, gbps: float, latency_us: float) -> Links:
        """These links on machines of `ranks` ranks each, joined by a network of `gbps`
        GB/s per rank and `latency_us` per call: a collective spanning machines costs
        the network's figures (see the module doc).

        Raises:
            ConfigError: a figure that is not positive (the latency may be 0).
        """
        if ranks < 1 or not 0 < gbps < math.inf or not 0 <= latency_us < math.inf:
            raise ConfigError(f"machines of {ranks} ranks joined at {gbps:g} GB/s and "
                              f"{latency_us:g} us per call: give a positive number of ranks "
                              "and bandwidth, and a latency of 0 or more")
        return dataclasses.replace(
            self, machine=ranks, network=(latency_us * 1e-6, 1 / (gbps * 1e9)),
            source=f"{self.source}; machines of {ranks} ranks, {gbps:g} GB/s per rank and "
                   f"{latency_us:g} us per call between them")

    def crosses(self, axis: str, layout: Dims) -> bool:
        """Whether a group of `axis` spans machines: its consecutive ranks (the axis's and
        those inside it) do not divide a machine's."""
        if not self.machine:
            return False
        inner = layout.cp * layout.tp
        spans = {"tp": layout.tp, "cp": inner, "ep": layout.ep * inner,
                 "dp": layout.dp_shard * inner, "edp": layout.dp_shard * inner,
                 "dp_replicate": layout.dp * inner, "pp": layout.pp * layout.dp * inner}
        return self.machine % spans[axis] != 0

    def seconds(self, traffic: dict[str, float], calls: dict[str, float],
                layout: Dims) -> float:
        """Time of a step's collectives ("axis op" -> bytes, calls) on `layout`."""
        sizes = {"dp": layout.dp_shard * layout.cp, "dp_replicate": layout.dp_replicate,
                 "tp": layout.tp, "pp": 2, "cp": layout.cp, "ep": layout.ep,
                 "edp": layout.dp_shard // layout.ep}
        total = 0.0
        for key, nbytes in traffic.items():
            axis, op = key.split(" ", 1)
            alpha, beta = self.network if self.network is not None and \
                self.crosses(axis, layout) else self.per_op.get(op, self.default)
            share = 1.0 if op == "send" else bus_factor(op, sizes[axis])
            total += calls[key] * alpha + nbytes * share * beta
        return total


def _fit(op: str, n: int, curves: dict[str, list]) -> tuple[float, float]:
    """(alpha, beta per bus byte) of the fastest algorithm at each end of the curves."""
    points = [sorted((int(b), float(t)) for b, t in pts) for pts in curves.values()]
    alpha = min(p[0][1] for p in points)
    slopes = [(p[-1][1] - p[-2][1]) / (p[-1][0] - p[-2][0]) for p in points if len(p) > 1]
    # curves are by each rank's input: an all-gather's whole buffer is n of them
    whole = n if op in PER_RANK_INPUT else 1
    beta = max(min(slopes), 1e-15) / (whole * bus_factor(op, n)) if slopes else \
        1 / (DEFAULT_GBPS * 1e9)
    return alpha, beta
