"""Expert parallelism: a mixture-of-experts Llama whose experts are split over the ranks.

    dtrain run -n 2 examples/expert_parallel.py

Each MoE block has 4 experts; each of the 2 ranks holds 2 of them and sends every token
to the rank of its experts and back (all-to-all). The rest of the model is replicated and
averaged as under plain data parallelism; each expert's gradient is averaged over the
ranks that hold it (here just one).
"""

import torch

import dtrain
from dtrain.models.llama import Llama, LlamaConfig
from dtrain.models.moe import MoEConfig, after_step, expert_parallel

world = dtrain.init()
mesh = dtrain.Mesh(dp=world.world_size, ep=world.world_size)  # experts over every rank
torch.manual_seed(0)  # every rank builds the same model, then keeps its experts
experts = MoEConfig(n_experts=4, experts_per_token=2, hidden=64, router="sigmoid_bias")
model = Llama(LlamaConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, n_head=4,
                          n_kv_head=2, ffn_hidden=128, moe=experts, moe_layers=(0, 1)))
expert_parallel(model, mesh.group("ep"), mesh.coords["ep"], mesh.size("ep"))
wrapped = dtrain.DataParallel(model, group=mesh.group("dp"), expert_group=mesh.group("edp"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40))
for step in range(30):
    starts = torch.randint(0, len(text) - 33, (4,), generator=torch.Generator().manual_seed(
        step * world.world_size + world.rank))  # this rank's 4 sequences
    x = torch.stack([text[s:s + 32] for s in starts])
    y = torch.stack([text[s + 1:s + 33] for s in starts])
    logits, loss = wrapped(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    after_step(model, mesh.group("dp"))  # the routers' biases move toward even load
    if step % 10 == 9 and world.is_main:
        imbalance = [round(layer.balance[0], 2) for layer in dtrain.models.moe.moe_layers(model)]
        print(f"step {step + 1}: loss {loss.item():.3f}, load max/mean per layer {imbalance}")
dtrain.shutdown()
