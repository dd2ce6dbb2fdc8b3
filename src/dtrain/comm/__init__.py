"""dtrain.comm: collectives with a choice of algorithm, checked and measured.

    from dtrain import comm
    comm.all_reduce(t)                                  # sum across the world, in place
    comm.all_reduce(t, op="avg", group=mesh.group("dp"), algorithm="ring")
    h = comm.all_gather(t, async_op=True); full = h.wait()
    comm.explain("all_reduce", 16 << 20)                # which algorithm auto picks, and why
    comm.quantized_all_gather(shard, "int8", out=full)  # sent as int8 with block scales

Algorithms written here over point-to-point messages: ring (reduce-scatter + all-gather,
pipelined), binomial tree (reduce, broadcast), recursive halving-doubling (Rabenseifner);
"native" is the backend's own. See each module's docstring for its cost. `quantized.py`:
all-gather and reduce-scatter sent in a lower-precision wire dtype (ZeRO++'s qwZ and qgZ).
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
    sent_total,
    traffic,
    waited,
)
from dtrain.comm.debug import CollectiveMismatch
from dtrain.comm.group import CollectiveTimeout, Group
from dtrain.comm.ops import ReduceOp, shard_sizes
from dtrain.comm.quantized import (
    Decoding,
    WireDtype,
    WireName,
    check_wire_dtype,
    quantized_all_gather,
    quantized_bytes,
    quantized_reduce_scatter,
)
from dtrain.comm.registry import GroupLike, add_twin, resolve, second_lane, wrap
from dtrain.comm.select import explain

__all__ = [
    "AVAILABLE", "CollectiveMismatch", "CollectiveTimeout", "Decoding", "Group", "GroupLike",
    "ReduceOp", "WireDtype", "WireName", "add_twin", "all_gather",
    "all_reduce", "all_to_all", "barrier", "broadcast", "check_wire_dtype", "explain", "gather",
    "quantized_all_gather", "quantized_bytes", "quantized_reduce_scatter", "recv", "reduce",
    "reduce_scatter", "resolve", "scatter", "second_lane", "send", "sent_total", "shard_sizes",
    "traffic", "waited", "wrap",
]
