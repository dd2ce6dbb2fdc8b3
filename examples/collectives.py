"""dtrain.comm's collectives, each algorithm giving the same answer.

    dtrain run -n 2 examples/collectives.py
"""
import torch

import dtrain
from dtrain import comm

world = dtrain.init()
r, n = world.rank, world.world_size
for algorithm in ("native", "ring", "tree", "halving_doubling"):
    t = torch.full((1000,), float(r + 1))
    comm.all_reduce(t, algorithm=algorithm)            # in place: 1 + 2 + ... + n
    assert torch.equal(t, torch.full((1000,), n * (n + 1) / 2))

t = torch.arange(4.0) + 10 * r
everyone = comm.all_gather(t, algorithm="ring")        # rank order along dim 0
shard = comm.reduce_scatter(torch.ones(2 * n), op="sum")   # this rank's piece of the sum
handle = comm.broadcast(torch.tensor([float(r)]), src=0, async_op=True)
from_rank0 = handle.wait()                             # wait() returns the result
sent = comm.traffic()                                  # bytes this rank sent, per collective
if world.is_main:
    print(f"all_gather: {everyone.tolist()}; reduce_scatter: {shard.tolist()}; "
          f"broadcast: {from_rank0.tolist()}; sent {sum(sent.values())} bytes")
