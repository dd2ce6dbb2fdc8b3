"""dtrain plan's memory figures against the measured peak of real runs, per strategy.

    dtrain run -n 2 benchmarks/plan_vs_measured.py [--layers 8 --embd 256 --batch 8]

Each strategy trains 3 steps of dtrain's GPT on 2 ranks (dtrain.planner.traced.measure: the
peak of live tensor bytes over the steady-state steps, the busiest rank); the planner
predicts the same layout from a trace on fake tensors. Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import dtrain
from dtrain.models.gpt import GPTConfig
from dtrain.planner import Layout, Links, estimate, profile_gpt
from dtrain.planner.traced.measure import measured_peak

STRATEGIES = [Layout(2), Layout(2, zero=1), Layout(2, zero=2), Layout(2, zero=3),
              Layout(1, tp=2), Layout(1, pp=2, microbatches=4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    world = dtrain.init()
    cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    rows = []
    for layout in STRATEGIES:
        peak = [0] * world.world_size
        dist.all_gather_object(peak, measured_peak(cfg, layout, args.batch))
        micro = args.batch // (layout.dp * layout.microbatches)
        planned = estimate(profile_gpt(cfg, micro), layout, 1e15, 1e12, Links.given(1, 0))
        rows.append((layout, planned, max(peak)))
    if world.is_main:
        print(f"GPT {args.layers}x{args.embd}, {args.heads} heads, sequence {args.block}, "
              f"global batch {args.batch}, AdamW, fp32, 2 ranks\n")
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
