"""Context parallelism traced on one rank: dtrain.context_parallel's own attention, over a
group whose messages move nothing.

The planner traces a context-parallel rank on fake tensors (dtrain.planner.traced.profile)
with the layout's `ContextParallel` set on the model, over a `Silent` group of cp members
seen from rank 0. Its sends complete at once, and its receives and collectives complete
into the buffers dtrain.comm allocates for them, of the size they would fill: the ring's
block in flight and the gradients coming home, the all-gather's keys and values, the
all-to-all's heads. So the trace counts what a real rank holds, the method's own work
included (the ring's scores, block by block, which grow with the square of a rank's
tokens).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from dtrain.comm.cost import Curve
from dtrain.comm.group import Done, Group, Handle
from dtrain.comm.ops import AVAILABLE
from dtrain.context_parallel import ContextParallel


class Silent(Group):
    """Rank 0 of a group of `size` whose messages move nothing (see the module doc);
    `auto` takes each collective's native algorithm, unmeasured."""

    backend = "traced"

    def __init__(self, size: int) -> None:
        super().__init__("traced")
        self.rank, self.size, self.name = 0, size, f"traced cp{size}"
        self.timeout = timedelta(seconds=1)
        self.cost_models = {op: {name: Curve(((1, 0.0 if name == "native" else 1.0),))
                                 for name in names} for op, names in AVAILABLE.items()}

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return Done()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return Done()

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        return Done()


def traced_context(cp: int, method: str) -> ContextParallel:
    """The attention of a rank of `cp` attending by `method`, for tracing.

    Raises:
        ConfigError: an unknown method.
    """
    return ContextParallel(Silent(cp), method)
