"""Tensor parallelism: one GPT's layers split across 2 ranks.

    dtrain run -n 2 examples/tensor_parallel.py

`parallelize` replaces the layers a plan names by column- and row-parallel ones holding
this rank's block of the weights; the model computes the same function as before.
"""
import torch

import dtrain
from dtrain import tensor_parallel as tp
from dtrain.models.gpt import GPT, GPTConfig

world = dtrain.init()
mesh = dtrain.Mesh(tp=world.world_size)                # every rank in one tp group
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
torch.manual_seed(0)
model = GPT(cfg)                                       # the whole model, same on every rank
tp.parallelize(model, tp.gpt_plan(cfg), mesh.group("tp"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

torch.manual_seed(1)                                   # the same batch on every rank
x, y = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
for _ in range(5):
    loss = model(x, y)[1]                              # logits stay split; the loss is whole
    loss.backward()
    tp.clip_grad_norm_(model, 1.0)                     # the norm of the whole gradient
    optimizer.step()
    optimizer.zero_grad()
weights = tp.full_state_dict(model)                    # loads into a plain GPT (collective)
GPT(cfg).load_state_dict(weights)
split = tp.parameter_bytes(model)
print(f"rank {world.rank}: loss {loss.item():.3f}; parameter bytes here: {split}")
