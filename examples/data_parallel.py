"""Data-parallel training of your own model with dtrain, in one file.

    dtrain run -n 2 examples/data_parallel.py          # 2 ranks on this machine
    python examples/data_parallel.py                    # the same script, one process

Each rank trains on its shard of every epoch; DataParallel averages the gradients, so the
ranks' copies of the model stay identical and the result equals one process on the whole batch.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtrain

world = dtrain.init()                       # rank, world_size, local_rank, ... (gloo/NCCL)
torch.manual_seed(0)
x = torch.randn(1024, 20)
y = (x[:, :10].sum(dim=1) > 0).long()       # a learnable toy task
dataset = TensorDataset(x, y)

model = dtrain.DataParallel(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sampler = dtrain.ShardedSampler(dataset, world.world_size, world.rank, seed=0)
loader = DataLoader(dataset, batch_size=64 // world.world_size, sampler=sampler)

for epoch in range(5):
    sampler.set_epoch(epoch)                # a new shuffle each epoch, the same on all ranks
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()                     # gradients are averaged across ranks here
        optimizer.step()
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    if world.is_main:
        print(f"epoch {epoch}: loss {loss.item():.3f}, accuracy {accuracy:.3f}")
