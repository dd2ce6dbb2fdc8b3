"""dtrain.comm: collectives with a choice of algorithm, checked and measured.

    from dtrain import comm
    comm.all_reduce(t)                                  # sum across the world, in place
    comm.all_reduce(t, op="avg", group=mesh.group("dp"), algorithm="ring")
    h = comm.all_gather(t, async_op=True); full = h.wait()
    comm.explain("all_reduce", 16 << 20)                # which algorithm auto picks, and why

Algorithms written here over point-to-point messages: ring (reduce-scatter + all-gather,
pipelined), binomial tree (reduce, broadcast), recursive halving-doubling (Rabenseifner);
"native" is the backend's own. See each module's docstring for its cost.
"""

from dtrain.comm.collectives import (
    AVAILABLE,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
    traffic,
    waited,
)
from dtrain.comm.debug import CollectiveMismatch
from dtrain.comm.group import CollectiveTimeout, Group
from dtrain.comm.ops import ReduceOp, shard_sizes
from dtrain.comm.registry import GroupLike, add_twin, resolve, second_lane, wrap
from dtrain.comm.select import explain

__all__ = [
    "AVAILABLE", "CollectiveMismatch", "CollectiveTimeout", "Group", "GroupLike", "ReduceOp",
    "add_twin", "all_gather",
    "all_reduce", "all_to_all", "barrier", "broadcast", "explain", "gather", "recv", "reduce",
    "reduce_scatter", "resolve", "scatter", "second_lane", "send", "shard_sizes", "traffic",
    "waited", "wrap",
]
