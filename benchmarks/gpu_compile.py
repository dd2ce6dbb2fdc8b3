"""dtrain's Llama on one GPU, eager against `[train] compile` and compile with FP8:
tokens/s, MFU and peak memory side by side in one run.

    python benchmarks/gpu_compile.py [--preset llama-3.2-1b --seq 2048 --batch 4 --json OUT]

The recipe is benchmarks/gpu_llama.py's (fp32 weights, bf16 autocast, fused AdamW, the same
random tokens). Modes, each a fresh model from the same seed: eager; each block compiled
(dtrain.models.compiled.compile_blocks, as `[train] compile = true` does); the blocks'
linears in FP8 (dtrain.models.float8, torchao; tensorwise and rowwise) and compiled, as
`[train] float8` with `compile` does. The first step's seconds (compiling) are reported
apart; the figure is the median of the timed steps after `--warmup`.
"""

from __future__ import annotations

import gc
import json
import time

import torch
from gpu_llama import arguments, dtrain_llama, peak_tflops, timed, train_step

from dtrain import models
from dtrain.models.compiled import compile_blocks
from dtrain.models.float8 import convert_to_float8
from dtrain.planner.shape import ModelShape

MODES = ("eager", "compiled", "compiled + fp8 tensorwise", "compiled + fp8 rowwise")


def build(shape: models.ModelConfig, mode: str) -> torch.nn.Module:
    model = dtrain_llama(shape, "none")
    if "fp8" in mode:
        convert_to_float8(model, mode.rsplit(" ", 1)[1])
    if mode != "eager":
        compile_blocks(model)
    return model


def main() -> None:
    args, shape = arguments(__doc__)
    flops = ModelShape.of(shape).model_flops_per_token()
    gpu, peak = peak_tflops()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (args.batch, args.seq + 1), generator=g).cuda()
    batch = (ids[:, :-1], ids[:, 1:])
    rows = []
    for mode in MODES:
        model = build(shape, mode)
        step = train_step(model, lambda m, x: m(x))
        start = time.perf_counter()
        step(*batch)  # compiles
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        seconds, losses, gib = timed(step, batch, args.warmup, args.steps)
        tokens = args.batch * args.seq / seconds
        rows.append({"mode": mode, "tokens_per_s": tokens, "mfu": tokens * flops / 1e12 / peak,
                     "first_step_s": first, "peak_gib": gib, "loss": losses[-1]})
        print(f"gpu-compile: {mode:28s} {tokens:9.0f} tok/s  MFU {rows[-1]['mfu']:.1%}  "
              f"first step {first:5.1f} s  peak {gib:5.1f} GiB  loss {losses[-1]:.3f}",
              flush=True)
        del model, step
        gc.collect()
        torch.cuda.empty_cache()
    eager = rows[0]["tokens_per_s"]
    for row in rows[1:]:
        print(f"gpu-compile: {row['mode']} / eager = {row['tokens_per_s'] / eager:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "preset": args.preset, "seq": args.seq,
                       "batch": args.batch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
