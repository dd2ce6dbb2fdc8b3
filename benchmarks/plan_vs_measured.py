"""dtrain plan's memory figures against the measured peak of real runs, per strategy.

    dtrain run -n 2 benchmarks/plan_vs_measured.py [--layers 8 --embd 256 --batch 8]
    dtrain run -n 4 benchmarks/plan_vs_measured.py --experts 8 [--expert-hidden 512]

Each strategy trains 3 steps of dtrain's GPT on 2 ranks (dtrain.planner.traced.measure: the
peak of live tensor bytes over the steady-state steps, the busiest rank); the planner
predicts the same layout from a trace on fake tensors. Rank 0 prints a Markdown table.

With `--experts E` the model is instead dtrain's Llama with E routed experts in every block
(top-2, each `--expert-hidden` wide; untied head) on 4 ranks, in the expert-parallel
layouts dp4, dp4 zero2, dp4 ep2, dp4 ep4, dp4 ep2 zero2 and dp4 ep2 zero3.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import dtrain
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPTConfig
from dtrain.planner import Dims, Links, estimate, profile_gpt, profile_model
from dtrain.planner.traced.measure import measured_peak

STRATEGIES = [Dims(2), Dims(2, zero=1), Dims(2, zero=2), Dims(2, zero=3),
              Dims(1, tp=2), Dims(1, pp=2, microbatches=4)]
EXPERT_STRATEGIES = [Dims(4), Dims(4, zero=2), Dims(4, ep=2), Dims(4, ep=4),
                     Dims(4, ep=2, zero=2), Dims(4, ep=2, zero=3)]
DEFAULTS = {"gpt": {"layers": 8, "embd": 256, "heads": 8},
            "moe": {"layers": 4, "embd": 256, "heads": 8}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int)
    parser.add_argument("--embd", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--experts", type=int, default=0,
                        help="routed experts per block: a MoE Llama on 4 ranks (0: GPT, 2 ranks)")
    parser.add_argument("--expert-hidden", type=int, default=512,
                        help="with --experts: each expert's hidden width (moe_inter_size)")
    args = parser.parse_args()
    for key, value in DEFAULTS["moe" if args.experts else "gpt"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    world = dtrain.init()
    strategies = EXPERT_STRATEGIES if args.experts else STRATEGIES
    need = strategies[0].world_size
    if world.world_size != need:
        raise SystemExit(f"run it on {need} ranks: dtrain run -n {need} ...")
    if args.experts:
        cfg: GPTConfig | ModelConfig = ModelConfig(
            arch="llama", vocab_size=256, block_size=args.block, n_layer=args.layers,
            n_head=args.heads, n_kv_head=args.heads // 2, n_embd=args.embd,
            tie_embeddings=False, n_experts=args.experts, experts_per_token=2,
            moe_inter_size=args.expert_hidden)
        profile = profile_model
        title = (f"Llama {args.layers}x{args.embd}, {args.heads} heads ({args.heads // 2} kv), "
                 f"{args.experts} experts of {args.expert_hidden} (top-2) in every block, "
                 f"untied head")
    else:
        cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads,
                        n_embd=args.embd)
        profile = profile_gpt
        title = f"GPT {args.layers}x{args.embd}, {args.heads} heads"
    rows = []
    for layout in strategies:
        peak = [0] * world.world_size
        dist.all_gather_object(peak, measured_peak(cfg, layout, args.batch))
        micro = args.batch // (layout.dp * layout.microbatches)
        planned = estimate(profile(cfg, micro), layout, 1e15, 1e12, Links.given(1, 0))
        rows.append((layout, planned, max(peak)))
    if world.is_main:
        print(f"{title}, sequence {args.block}, global batch {args.batch}, AdamW, fp32, "
              f"{need} ranks\n")
        print("| layout | planned MiB (params / grads / optimizer / activations) | "
              "measured peak MiB | planned / measured |")
        print("|---|---|---|---|")
        for layout, e, peak in rows:
            mib = 2**20
            print(f"| {layout} | {e.total / mib:.1f} ({e.params / mib:.1f} / {e.grads / mib:.1f}"
                  f" / {e.optimizer / mib:.1f} / {e.activations / mib:.1f}) | "
                  f"{peak / mib:.1f} | {e.total / peak:.2f} |")
    dtrain.shutdown()


if __name__ == "__main__":
    main()
