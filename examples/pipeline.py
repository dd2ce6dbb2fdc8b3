"""Pipeline parallelism: a model cut into 2 stages, micro-batches flowing through them.

    dtrain run -n 2 examples/pipeline.py
"""
import torch
from torch import nn

import dtrain
from dtrain import pipeline

world = dtrain.init()
torch.manual_seed(0)                                   # the same model on every rank
model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)),
                      nn.Linear(32, 1))
pieces = pipeline.split(model, parts=world.world_size)  # consecutive layers per stage
mine = pipeline.pieces_for(pieces)                     # this rank's stage
pipe = pipeline.Pipeline(mine, microbatches=4, schedule="1f1b",
                         loss_fn=nn.functional.mse_loss)
optimizer = torch.optim.SGD(nn.ModuleList(mine).parameters(), lr=0.05)

torch.manual_seed(1)
x, y = torch.randn(16, 32), torch.randn(16, 1)         # every rank passes the whole batch
for _ in range(10):
    loss = pipe.step(x, y)          # every micro-batch's forward and backward
    pipe.clip_grad_norm_(1.0)       # over every stage
    optimizer.step()
    optimizer.zero_grad()
print(f"stage {world.rank}: loss {loss.item():.4f}, peak of {pipe.peak_live} live "
      f"micro-batches of activations")
