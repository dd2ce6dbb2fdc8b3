"""A model 3x bigger than one rank's memory: `dtrain run -n 4 examples/bigger_than_a_rank.py`.

Training with AdamW holds 16 bytes per parameter (the weights, their gradients, Adam's two
moments) plus the activations. Here each rank may hold a third of what one process needs
(a cap on its live tensor bytes), yet four ranks train the model: it is built in split
form (no rank ever holds it whole), ZeRO stage 3 keeps a quarter of the state on each
rank, and every block's activations are recomputed in backward.
"""
import torch

import dtrain
from dtrain import layouts, models
from dtrain.config import config_from_dict, dims_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.planner import LiveBytes

world = dtrain.init()


def train(model_keys: dict, steps: int) -> float:
    """Build the model in split form as `dtrain train` does, then train `steps` steps."""
    config = config_from_dict({
        "model": model_keys, "parallel": {"nproc": world.world_size, "zero": 3},
        "memory": {"recompute": "full"}, "train": {"batch_size": 4}})
    dims = dims_of(config, world.world_size)
    shape = models.resolve(config.model, data_vocab=256)
    model = init.skeleton(lambda: models.build(shape))      # no memory yet
    held = layouts.build(model, Mesh(dims), config)  # a quarter, filled
    data = torch.Generator().manual_seed(world.rank)
    for _ in range(steps):
        x = torch.randint(0, 256, (1, shape.block_size), generator=data)
        loss = held.forward_backward([(x, x.roll(-1, 1))])
        held.step()
        held.zero_grad()
    return loss.item()


train({"n_layer": 1, "n_embd": 32, "n_head": 2}, steps=1)  # collectives calibrate once

big = {"n_layer": 32, "n_embd": 128, "n_head": 4, "block_size": 32}
params = 32 * (12 * 128 * 128 + 13 * 128) + (256 + 32 + 2) * 128  # 6.4M parameters
one_process = 16 * params                                  # bytes of its training state
cap = one_process // 3
with LiveBytes(limit=cap) as live:                         # MemoryError past the cap
    loss = train(big, steps=3)
print(f"rank {world.rank}: {params / 1e6:.1f}M parameters, one process needs "
      f"{one_process / 2**20:.0f} MiB of state; this rank peaked at "
      f"{live.peak / 2**20:.0f} MiB under a cap of {cap / 2**20:.0f} MiB; loss {loss:.3f}")
