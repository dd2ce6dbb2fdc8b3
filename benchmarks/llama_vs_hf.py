"""dtrain's built-in Llama against the same shape in Hugging Face transformers, both under
dtrain's DataParallel, side by side in one run.

    dtrain run -n 2 benchmarks/llama_vs_hf.py [--rounds 15 --steps 4 --write]

Both models have the same shape (llama-tiny's widths by default: grouped-query attention,
SwiGLU, RMSNorm, untied head) and the same weights (dtrain's copied into transformers'
`LlamaForCausalLM` through dtrain.models.convert), see the same batches and use the same
optimizer. Hugging Face's loss is computed by dtrain's wrapper (arch "hf"), as `dtrain
train` does. Timing alternates between the two in rounds (order flipped every round) so
machine noise hits both alike; the figure is the median tokens/s over rounds, and the
comparison is repeated (`--repeats`) to show its spread. With
--write, rank 0 replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform

import torch
from dp_vs_ddp import alternate, step_fn
from results_md import replace_section

import dtrain
from dtrain import models
from dtrain.models.convert import hf_config_of, hf_names


def make_pair(shape: models.ModelConfig):
    """dtrain's Llama and transformers' Llama with the same weights."""
    import transformers

    from dtrain.models.hf import HFCausalLM

    torch.manual_seed(0)
    ours = models.build(shape)
    config = transformers.AutoConfig.for_model(**hf_config_of(shape))
    config._attn_implementation = "sdpa"
    theirs = transformers.AutoModelForCausalLM.from_config(config)
    state = {hf: (t.t() if transposed else t) for name, t in ours.state_dict().items()
             for hf, transposed in [hf_names(shape).get(name, (None, False))] if hf}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    wrapped = HFCausalLM(theirs, shape.block_size)
    return dtrain.DataParallel(ours), dtrain.DataParallel(wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    world = dtrain.init()
    shape = models.resolve(models.ModelConfig(arch="llama", preset=args.preset), 256)
    shape = dataclasses.replace(shape, vocab_size=256)
    ours, theirs = make_pair(shape)
    g = torch.Generator().manual_seed(world.rank)
    ids = torch.randint(0, 256, (args.batch, shape.block_size + 1), generator=g)
    batch = (ids[:, :-1], ids[:, 1:])
    with torch.no_grad():  # the same function before any step
        torch.testing.assert_close(ours(batch[0]), theirs(batch[0]), rtol=1e-4, atol=1e-5)
    steps = {name: step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch)
             for name, model in (("dtrain", ours), ("transformers", theirs))}
    tokens = args.batch * shape.block_size * world.world_size
    runs = []  # the whole comparison `repeats` times: the spread says how quiet it was
    for _ in range(args.repeats):
        seconds = alternate(steps, args.rounds, args.steps, warmup=2)
        runs.append({name: tokens / t for name, t in seconds.items()})
    runs.sort(key=lambda r: r["dtrain"] / r["transformers"])
    rate = runs[len(runs) // 2]  # the run of median ratio
    ratio = rate["dtrain"] / rate["transformers"]
    ratios = ", ".join(f"{r['dtrain'] / r['transformers']:.3f}" for r in runs)
    if not world.is_main:
        return
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"dtrain {rate['dtrain']:,.0f} tok/s  transformers {rate['transformers']:,.0f} "
          f"tok/s  ratio {ratio:.3f} (all runs: {ratios})")
    if args.write:
        replace_section("llama_vs_hf", [
            "## dtrain's Llama vs Hugging Face transformers' Llama (tokens/s, 2 ranks)",
            "",
            f"Command: `dtrain run -n {world.world_size} benchmarks/llama_vs_hf.py --rounds "
            f"{args.rounds} --steps {args.steps} --repeats {args.repeats} --write`  ",
            f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
            f"gloo; model: {args.preset} shape ({n_params / 1e6:.2f}M params, "
            f"{shape.n_layer} layers, width {shape.n_embd}, {shape.n_head}/{shape.n_kv_head} "
            f"heads, {shape.block_size} tokens), {args.batch} sequences per rank, AdamW, both "
            f"under dtrain.DataParallel; median of {args.rounds} rounds x {args.steps} steps, "
            f"the whole comparison run {args.repeats} times (ratios {ratios}; the median "
            f"run below; load average {os.getloadavg()[0]:.1f} at the end, the 2 ranks "
            "themselves).",
            "",
            "| model | tokens/s | ratio (dtrain / transformers) |",
            "|---|---|---|",
            f"| dtrain `arch = \"llama\"` | {rate['dtrain']:,.0f} | **{ratio:.3f}** |",
            f"| transformers `LlamaForCausalLM` (`arch = \"hf\"`) | "
            f"{rate['transformers']:,.0f} | 1 |",
            "",
            "Target: ratio at least 1.0 (the built-in at least as fast).",
        ])


if __name__ == "__main__":
    main()
