"""dtrain's Llama on one GPU: tokens/s, MFU and peak memory in bf16, with and without
activation checkpointing, beside the same shape in Hugging Face transformers and in
torchtitan, each trained by a plain torch loop, side by side in one run.

    python benchmarks/gpu_llama.py [--preset llama-3.2-1b --seq 2048 --batch 4 --json OUT]

Every model gets the same recipe: fp32 weights, bf16 autocast, fused AdamW, the same random
tokens, loss in fp32 over the whole vocabulary. dtrain's weights are copied into
transformers' model (dtrain.models.convert), so their first losses must agree. torchtitan's
Llama (torchtitan 0.2.2, carried as a wheel: 0.3 needs a newer torch than the GPU machine
has) gets the same widths, heads, FFN and vocabulary and keeps its own initialization.

MFU is model FLOPs per token (the planner's count: 6N + 12·l·h·s, recomputation not
counted, as dtrain plan and Meta count it) times tokens/s over the GPU's dense bf16 peak
(the planner's datasheet preset). Each model runs `--warmup` steps, then `--steps` timed
ones; the figure is the median step. Models run one after the other in one process, memory
freed between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtrain import models
from dtrain.models import recompute
from dtrain.models.convert import hf_config_of, hf_names
from dtrain.planner.analytic.hardware import PRESETS as HARDWARE
from dtrain.planner.shape import ModelShape

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def peak_tflops() -> tuple[str, float]:
    """The GPU's dense bf16 rate from the planner's presets (by its name)."""
    name = torch.cuda.get_device_name().lower()
    key = "h200" if "h200" in name else "h100-80gb" if "h100" in name else "a100-80gb"
    return key, HARDWARE[key].peak_tflops


def timed(step: Step, batch: tuple[torch.Tensor, torch.Tensor], warmup: int,
          steps: int) -> tuple[float, list[float], float]:
    """(median step seconds, losses of every step, peak GiB)."""
    torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(*batch)
        torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    return statistics.median(seconds), losses, torch.cuda.max_memory_allocated() / 2**30


def train_step(model: torch.nn.Module, logits_of: Callable) -> Step:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def dtrain_llama(shape: models.ModelConfig, mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = models.build(shape)
    recompute.recompute_mode(model, mode)
    return model


def hf_llama(shape: models.ModelConfig) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with dtrain's seed-0 weights."""
    import transformers

    ours = dtrain_llama(shape, "none")
    config = transformers.AutoConfig.for_model(**hf_config_of(shape))
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    state = {hf: (t.t() if transposed else t) for name, t in ours.state_dict().items()
             for hf, transposed in [hf_names(shape).get(name, (None, False))] if hf}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    theirs.tie_weights()
    del ours
    return theirs


def torchtitan_llama(shape: models.ModelConfig) -> tuple[torch.nn.Module, Callable]:
    """torchtitan's Llama 3 (`Transformer` of torchtitan 0.2, SDPA causal attention) with
    the same widths, heads, FFN and vocabulary, initialized by torchtitan itself. Its head
    is not tied to the embedding (torchtitan 0.2 has no tying): more parameters, the same
    FLOPs per token."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(
        dim=shape.n_embd, n_layers=shape.n_layer, n_heads=shape.n_head,
        n_kv_heads=shape.n_kv_head, vocab_size=shape.vocab_size, multiple_of=1024,
        ffn_dim_multiplier=1.5, rope_theta=shape.rope_theta, max_seq_len=shape.block_size)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))
    ffn = model.layers["0"].feed_forward.w1.out_features
    assert ffn == shape.ffn_hidden, f"torchtitan's FFN is {ffn}, dtrain's {shape.ffn_hidden}"
    return model, lambda m, x: m(x)


def arguments(doc: str) -> tuple[argparse.Namespace, models.ModelConfig]:
    """The GPU benchmarks' command line (preset, sequence, batch, warm-up and timed steps,
    JSON output) and the Llama shape it names."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    shape = models.resolve(models.ModelConfig(arch="llama", preset=args.preset), 128256)
    return args, dataclasses.replace(shape, block_size=args.seq)


def main() -> None:
    args, shape = arguments(__doc__)
    flops = ModelShape.of(shape).model_flops_per_token()
    gpu, peak = peak_tflops()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (args.batch, args.seq + 1), generator=g).cuda()
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    tokens = args.batch * args.seq

    def ours(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def hf(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(input_ids=x).logits

    runs: dict[str, Callable[[], tuple[torch.nn.Module, Callable]]] = {
        "dtrain": lambda: (dtrain_llama(shape, "none"), ours),
        "dtrain, selective recomputation": lambda: (dtrain_llama(shape, "selective"), ours),
        "dtrain, full recomputation": lambda: (dtrain_llama(shape, "full"), ours),
        "transformers LlamaForCausalLM": lambda: (hf_llama(shape), hf),
        "torchtitan Llama3 (same shape, untied head)": lambda: torchtitan_llama(shape),
    }
    results = []
    for name, make in runs.items():
        try:
            model, logits_of = make()
            params = sum(p.numel() for p in model.parameters())
            seconds, losses, peak_gib = timed(train_step(model, logits_of), batch,
                                              args.warmup, args.steps)
            rate = tokens / seconds
            row = {"model": name, "params": params, "tokens_per_s": rate,
                   "step_s": seconds, "tflops": rate * flops / 1e12,
                   "mfu": rate * flops / (peak * 1e12), "peak_gib": peak_gib,
                   "first_loss": losses[0], "last_loss": losses[-1]}
        except Exception as exc:  # a baseline that cannot run here is reported, not fatal
            row = {"model": name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                   "trace": traceback.format_exc()[-2000:]}
        finally:
            model = logits_of = None
            gc.collect()
            torch.cuda.empty_cache()
        results.append(row)
        if "error" in row:
            print(f"gpu-llama: {name}: FAILED {row['error']}", flush=True)
        else:
            print(f"gpu-llama: {name}: {row['tokens_per_s']:,.0f} tok/s, "
                  f"{row['tflops']:.0f} TFLOP/s, MFU {row['mfu']:.1%}, peak "
                  f"{row['peak_gib']:.1f} GiB, loss {row['first_loss']:.4f} -> "
                  f"{row['last_loss']:.4f}", flush=True)
    summary = {"device": torch.cuda.get_device_name(), "gpu_preset": gpu, "peak_tflops": peak,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "shape": {"preset": args.preset, "seq": args.seq, "batch": args.batch,
                         "flops_per_token": flops},
               "warmup": args.warmup, "steps": args.steps, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
