"""A DataParallel training step of the default GPT with gradients reduced over shared
memory (dtrain's shm backend) against gloo, side by side in one run.

    dtrain run -n 2 --backend shm benchmarks/dp_shm_vs_gloo.py [--rounds 15 --steps 5 --write]

Two copies of the model from the same weights, one DataParallel on the world's shm group
and one on a gloo group of the same ranks, take turns in rounds (order flipped every
round) on the same batches; the figure is the median per-step time over rounds.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.distributed as dist
from dp_vs_ddp import alternate, step_fn
from results_md import replace_section

import dtrain
from dtrain import comm
from dtrain.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    world = dtrain.init(backend="shm")
    groups = {"shm": comm.resolve(None), "gloo": comm.wrap(dist.new_group(backend="gloo"), "gloo")}
    g = torch.Generator().manual_seed(world.rank)
    batch = (torch.randint(0, 256, (args.batch, 128), generator=g),
             torch.randint(0, 256, (args.batch, 128), generator=g))
    models, steps = {}, {}
    for name, group in groups.items():
        torch.manual_seed(0)
        models[name] = dtrain.DataParallel(GPT(GPTConfig()), group=group)
        steps[name] = step_fn(models[name], torch.optim.AdamW(models[name].parameters(), lr=1e-3),
                              batch)
    seconds = alternate(steps, args.rounds, args.steps)
    drift = max((a - b).abs().max().item() for a, b in zip(
        models["shm"].module.parameters(), models["gloo"].module.parameters(), strict=True))
    ms = {name: t * 1e3 for name, t in seconds.items()}
    if not world.is_main:
        return
    ratio = ms["shm"] / ms["gloo"]
    print(f"shm {ms['shm']:.1f} ms  gloo {ms['gloo']:.1f} ms  ratio {ratio:.3f}  "
          f"max param diff {drift:.1e}")
    if args.write:
        replace_section("dp_shm_vs_gloo", [
            f"## DataParallel step on shm vs gloo ({world.world_size} ranks)",
            "",
            f"Command: `dtrain run -n {world.world_size} --backend shm "
            f"benchmarks/dp_shm_vs_gloo.py --rounds {args.rounds} --steps {args.steps} --write`  ",
            f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}; "
            f"model: default GPT (0.84M params), {args.batch} sequences x 128 bytes per rank, "
            f"AdamW, fp32 gradients; median of {args.rounds} rounds x {args.steps} steps.",
            "",
            "| shm ms/step | gloo ms/step | ratio (shm / gloo) | max param diff |",
            "|---|---|---|---|",
            f"| {ms['shm']:.1f} | {ms['gloo']:.1f} | **{ratio:.3f}** | {drift:.1e} |",
        ])


if __name__ == "__main__":
    main()
