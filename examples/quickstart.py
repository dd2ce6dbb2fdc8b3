"""Data parallel in a few lines: `dtrain run -n 2 examples/quickstart.py`."""
import torch

import dtrain

world = dtrain.init()                               # rank and world size from `dtrain run`
torch.manual_seed(0)                                # the same data on every rank
x, y = torch.randn(256, 8), torch.randn(256, 1)
model = dtrain.DataParallel(torch.nn.Linear(8, 1))  # rank 0's weights on every rank
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
mine = slice(world.rank, None, world.world_size)    # this rank's share of the batch
for _ in range(50):
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    optimizer.zero_grad()
    loss.backward()                                 # averages the gradients across ranks
    optimizer.step()
print(f"rank {world.rank}/{world.world_size}: loss {loss.item():.4f}")
