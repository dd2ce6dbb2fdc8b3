"""Mixture of experts, side by side in one run (2 ranks):

1. dtrain's MoE layer against transformers' Mixtral sparse block of the same shape (same
   weights, same tokens), each under dtrain.DataParallel: tokens/s of forward + backward +
   the gradients' all-reduce + AdamW.
2. Expert parallelism: the same MoE Llama at ep = 1 (every rank holds every expert) and
   ep = 2 (each holds half), on the same global batch: the experts' bytes per rank
   (parameters, gradients, AdamW's two moments), the step time, and the share of the step
   spent in the all-to-all exchanges (dispatch and combine, forward and backward).

    dtrain run -n 2 benchmarks/moe.py [--rounds 11 --steps 3 --write]

Timing alternates between the two contenders in rounds (order flipped every round, as
benchmarks/dp_vs_ddp.py times its pair) so machine noise hits both alike; figures are
medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from dp_vs_ddp import alternate, time_steps
from results_md import replace_section

import dtrain
from dtrain.models.llama import Llama, LlamaConfig
from dtrain.models.moe import MoE, MoEConfig, after_step, expert_parallel
from dtrain.models.moe import experts as experts_mod

DIM, HIDDEN, E, K = 256, 512, 8, 2


def trainer(model: torch.nn.Module, module: torch.nn.Module, batch, loss_of):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        loss_of(module, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


LAYERS = {"mixtral-like": (8, 2, 512), "fine-grained": (64, 8, 128)}
"""The two layer shapes compared (experts, top-k, expert hidden width; dim 256): each token
computes 2 x 512 = 8 x 128 expert units in both."""


def layer_vs_transformers(args: argparse.Namespace, world: dtrain.World, experts: int,
                          k: int, hidden: int) -> dict:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    ours = MoE(MoEConfig(n_experts=experts, experts_per_token=k, hidden=hidden), DIM)
    theirs = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=DIM, intermediate_size=hidden, num_local_experts=experts,
        num_experts_per_tok=k))
    with torch.no_grad():  # the same weights: router, and the experts' stacked tensors
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
    x = torch.randn(args.tokens // 512, 512, DIM, generator=torch.Generator().manual_seed(
        world.rank))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)

    def loss_of(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).pow(2).mean()

    steps = {"dtrain": trainer(ours, dtrain.DataParallel(ours), x, loss_of),
             "transformers": trainer(theirs, dtrain.DataParallel(theirs), x, loss_of)}
    median = alternate(steps, args.rounds, args.steps, warmup=2)
    tokens = x.shape[0] * x.shape[1] * world.world_size
    return {name: tokens / seconds for name, seconds in median.items()}


class ExchangeClock:
    """Seconds spent inside the MoE layers' all-to-all exchanges (dtrain.models.moe's
    `exchange`, forward and backward), and how many steps they cover."""

    def __init__(self) -> None:
        self.seconds, self.original = 0.0, experts_mod.exchange

    def __enter__(self) -> ExchangeClock:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        experts_mod.exchange = timed
        return self

    def __exit__(self, *exc: object) -> None:
        experts_mod.exchange = self.original


def moe_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_kv_head=2,
                             n_embd=DIM, ffn_hidden=HIDDEN,
                             moe=MoEConfig(n_experts=E, experts_per_token=K, hidden=HIDDEN),
                             moe_layers=(0, 1, 2, 3)))


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the experts' parameters, gradients and AdamW moments on this rank."""
    return sum(4 * p.numel() * 4 for name, p in model.named_parameters() if "experts." in name)


def ep_vs_whole(args: argparse.Namespace, world: dtrain.World) -> dict:
    meshes = {ep: dtrain.Mesh(dp=world.world_size, ep=ep) for ep in (1, world.world_size)}
    g = torch.Generator().manual_seed(world.rank)
    batch = (torch.randint(0, 256, (args.tokens // 256, 256), generator=g),
             torch.randint(0, 256, (args.tokens // 256, 256), generator=g))
    steps, sizes, models = {}, {}, {}
    for ep, mesh in meshes.items():
        model = moe_llama()
        if ep > 1:
            expert_parallel(model, mesh.group("ep"), mesh.coords["ep"], ep)
        wrapped = dtrain.DataParallel(model, group=mesh.group("dp"),
                                      expert_group=mesh.group("edp") if ep > 1 else None)
        inner = trainer(model, wrapped, batch, lambda m, b: m(*b)[1])

        def step(inner=inner, model=model, mesh=mesh) -> None:
            inner()
            after_step(model, mesh.group("dp"))

        steps[f"ep{ep}"], sizes[f"ep{ep}"], models[f"ep{ep}"] = step, expert_bytes(model), model
    median = alternate(steps, args.rounds, args.steps, warmup=2)
    with ExchangeClock() as clock:  # the ep run's exchanges, timed apart from the rounds
        total = args.rounds * time_steps(steps[f"ep{world.world_size}"], args.rounds)
    return {"ms": {n: s * 1e3 for n, s in median.items()}, "bytes": sizes,
            "exchange_share": clock.seconds / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = dtrain.init()
    layers = {name: layer_vs_transformers(args, world, *shape)
              for name, shape in LAYERS.items()}
    ep = ep_vs_whole(args, world)
    if world.is_main:
        memory = ep["bytes"][f"ep{world.world_size}"] / ep["bytes"]["ep1"]
        step = ep["ms"][f"ep{world.world_size}"] / ep["ms"]["ep1"]
        for name, layer in layers.items():
            print(f"{name} layer: dtrain {layer['dtrain']:,.0f} tok/s, transformers "
                  f"{layer['transformers']:,.0f} tok/s, ratio "
                  f"{layer['dtrain'] / layer['transformers']:.2f}")
        print(f"ep: experts {ep['bytes']} bytes per rank (ratio {memory:.2f}); step "
              f"{ep['ms']} ms (ratio {step:.2f}); all-to-all {ep['exchange_share']:.1%} of "
              "the ep step")
        if args.write:
            write(args, world, layers, ep, memory, step)
    dtrain.shutdown()


def write(args, world, layers, ep, memory, step) -> None:
    n = world.world_size
    lines = [
        f"## Mixture of experts: the layer vs transformers' Mixtral block, and ep = {n} vs "
        f"ep = 1 ({n} ranks)",
        "",
        f"Command: `dtrain run -n {n} benchmarks/moe.py --rounds {args.rounds} --steps "
        f"{args.steps} --write`  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
        f"gloo, one thread per rank; {args.tokens} tokens per rank per step; medians of "
        f"{args.rounds} rounds x {args.steps} steps, the contenders alternating.",
        "",
        f"The layer (dim {DIM}; same weights, same tokens, both under dtrain.DataParallel, "
        "AdamW), dtrain's `MoE` (grouped products) against transformers' "
        "`MixtralSparseMoeBlock` (a loop over the experts that got tokens):",
        "",
        "| shape | dtrain tokens/s | transformers tokens/s | ratio |",
        "|---|---|---|---|",
        *[f"| {name}: {LAYERS[name][0]} experts, top-{LAYERS[name][1]}, hidden "
          f"{LAYERS[name][2]} | {layer['dtrain']:,.0f} | {layer['transformers']:,.0f} | "
          f"**{layer['dtrain'] / layer['transformers']:.2f}** |"
          for name, layer in layers.items()],
        "",
        f"Target: at least 1.5. Expert parallelism (a MoE Llama of 4 blocks, each {E} experts, "
        f"dim {DIM}, 256-token sequences, the same global batch):",
        "",
        "| | experts' bytes per rank (params, grads, AdamW) | ms per step |",
        "|---|---|---|",
        f"| ep = 1 | {ep['bytes']['ep1']:,} | {ep['ms']['ep1']:.1f} |",
        f"| ep = {n} | {ep['bytes'][f'ep{n}']:,} | {ep['ms'][f'ep{n}']:.1f} |",
        f"| ratio | **{memory:.2f}** | {step:.2f} |",
        "",
        f"Target: expert memory at most 0.55x. At ep = {n} the all-to-all exchanges took "
        f"{ep['exchange_share']:.1%} of the step (timed inside dtrain.models.moe's exchange, "
        "forward and backward).",
        "",
        "The layer's target (1.5x) is met for fine-grained experts and missed for Mixtral's "
        "shape: with 8 experts transformers' loop is 8 matrix products per projection, and "
        "on this CPU one grouped product costs about as much as those 8 (mkl's own products "
        "over 512-row slices); the gain comes where a loop over many small experts pays "
        "per-call overhead 64 or 128 times (Qwen3's, DeepSeek's shapes), and on GPUs, where "
        "torch._grouped_mm is one kernel. ep = 2 halves the experts' memory; on one machine "
        "of 2 cores the step gets slower, not faster: both ranks already compute, and the "
        "exchanges add their time. Load average at the end of the run: "
        f"{os.getloadavg()[0]:.1f} (the 2 ranks themselves).",
    ]
    replace_section("moe", lines)


if __name__ == "__main__":
    main()
