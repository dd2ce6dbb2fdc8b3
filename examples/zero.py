"""Sharded data parallelism (ZeRO): `dtrain run -n 2 examples/zero.py`.

Each rank keeps 1/N of the optimizer state and gradients (stage 2), and of the
parameters too (stage 3), yet trains the same model as one process would.
"""
import torch
from torch import nn

import dtrain

world = dtrain.init()
torch.manual_seed(0)
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
mine = slice(world.rank, None, world.world_size)          # this rank's half of the batch

for stage in (2, 3):
    torch.manual_seed(1)                                  # the same model on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    model = dtrain.ZeRO(net, lambda params: torch.optim.AdamW(params, lr=1e-2), stage=stage)
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        model.backward(loss)          # reduce-scatter: each rank gets its shard's gradient
        model.clip_grad_norm_(1.0)    # the norm of the whole gradient, across shards
        model.step()                  # update this rank's shard, then share the parameters
        model.zero_grad()
    held = sum(model.state_bytes().values())
    print(f"stage {stage}, rank {world.rank}: loss {loss.item():.3f}, "
          f"{held} bytes of model state held here")
