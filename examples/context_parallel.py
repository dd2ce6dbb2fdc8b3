"""Context parallelism: each rank holds two of a sequence's chunks, through the whole model.

    dtrain run -n 2 examples/context_parallel.py

Every sequence of 64 tokens is cut into 4 chunks; rank 0 holds chunks 0 and 3, rank 1
chunks 1 and 2 (so both attend over as many key-query pairs). Embeddings, norms, MLPs,
head and loss run on a rank's 32 tokens; attention meets the other rank's keys and values
as they go around the ring. The model is replicated over cp, so DataParallel averages its
gradients over the dp x cp ranks.
"""

import torch

import dtrain
from dtrain.context_parallel import ContextParallel, chunks
from dtrain.models import context
from dtrain.models.llama import Llama, LlamaConfig

world = dtrain.init()
mesh = dtrain.Mesh(dp=1, cp=world.world_size)
torch.manual_seed(0)  # every rank builds the same model
model = Llama(LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_embd=64, n_head=4,
                          n_kv_head=2, ffn_hidden=128))
cp = ContextParallel(mesh.group("cp"), method="ring")  # or "allgather", "alltoall"
context.apply(model, cp)
wrapped = dtrain.DataParallel(model, group=mesh.group("dp", "cp"))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40))
for step in range(30):
    starts = torch.randint(0, len(text) - 65, (4,),
                           generator=torch.Generator().manual_seed(step))  # alike on cp ranks
    x = torch.stack([text[s:s + 64] for s in starts])
    y = torch.stack([text[s + 1:s + 65] for s in starts])
    logits, loss = wrapped(chunks.shard(x, cp.rank, cp.size), chunks.shard(y, cp.rank, cp.size))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = dtrain.comm.all_reduce(loss.detach(), op="avg", group=mesh.group("cp"))
    if step % 10 == 9 and world.is_main:
        print(f"step {step + 1}: loss {mean.item():.3f} (the whole sequences')")
dtrain.shutdown()
