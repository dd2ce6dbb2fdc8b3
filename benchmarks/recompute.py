"""Activation checkpointing on dtrain's Llama: memory kept from forward and step time of
"none", "selective" and "full", without and with attention dropout.

    python benchmarks/recompute.py [--rounds 10 --steps 3 --repeats 3 --write]

One process, 1 thread, the llama-tiny shape (vocabulary 256), 8 sequences x 128 tokens,
AdamW. For each dropout (0 and 0.1 on the attention probabilities) the three modes get
their own model from the same seed, recomputed by
`dtrain.models.recompute.recompute_mode(model, mode)`.

Memory (dtrain.planner.LiveBytes, live tensor bytes, the CPU's
max_memory_allocated): the model and its AdamW state exist before the tracker starts, so
what it sees is the step's own: the bytes alive once forward has returned the loss
(activations kept for backward, logits and loss), and the peak over forward and backward
(those plus the gradients, 4 bytes per parameter, and backward's temporaries).

Time: a step is forward, backward, AdamW step, zero_grad. The three modes take turns in
rounds (order reversed every round) so the machine's noise hits them alike; each figure is
the median over rounds, and the whole comparison is repeated `--repeats` times (the table
shows the repeat of median full/none ratio, the others' ratios beside it).

On the CPU, PyTorch's scaled_dot_product_attention without dropout runs a fused kernel
that keeps only its output and log-sum-exp, so recomputing the attention core
("selective") saves little there; with dropout it falls back to the math kernel, which
keeps the T x T attention probabilities (before and after dropout), and selective drops
them.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import statistics
import time

import torch
from dp_vs_ddp import step_fn
from results_md import replace_section, run_summary

from dtrain import models
from dtrain.config import OptimizerConfig
from dtrain.models.recompute import recompute_mode
from dtrain.optim import build_optimizer
from dtrain.planner import LiveBytes

MODES = ("none", "selective", "full")
MiB = 2**20


def build(dropout: float, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    shape = models.resolve(models.ModelConfig(arch="llama", preset="llama-tiny",
                                              dropout=dropout), 256)
    torch.manual_seed(0)
    model = models.build(shape)
    recompute_mode(model, mode)
    return model, build_optimizer(model.parameters(), OptimizerConfig())


def batch(size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (size, length + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def memory(model, optimizer, data) -> dict[str, int]:
    """Bytes alive after forward, and the peak over forward and backward (model state
    excluded: it was made before the tracker started)."""
    step_fn(model, optimizer, data)()  # AdamW's state exists from here on
    tracker = LiveBytes()
    with tracker:
        loss = model(*data)[1]
        kept = tracker.live
        loss.backward()
    optimizer.zero_grad(set_to_none=True)
    return {"kept": kept, "peak": tracker.peak}


def saved_by_module(model, data) -> dict[str, int]:
    """What a forward keeps for backward, by the innermost module that keeps it (block
    numbers as `*`: "blocks.*.mlp.act"; a tensor kept by several, such as a norm's output
    read by q, k and v, counts once, for the first): bytes of each storage, parameters
    left out."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: dict[str, int] = collections.Counter()
    inside: list[str] = []
    handles = []
    for name, module in model.named_modules():
        label = re.sub(r"\.\d+(\.|$)", r".*\1", name) or "(the model: logits, loss)"
        handles.append(module.register_forward_pre_hook(
            lambda m, a, label=label: inside.append(label)))
        handles.append(module.register_forward_hook(lambda m, a, o: inside.pop() and None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[inside[-1] if inside else "(the loss)"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*data)
    for handle in handles:
        handle.remove()
    return dict(out)


def time_steps(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def alternate(steps: dict, rounds: int, per_round: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per step of each of `steps` (name -> step), in `rounds` rounds of
    `per_round` steps, their order reversed every round (one process: no barrier)."""
    for step in steps.values():
        time_steps(step, warmup)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            times[name].append(time_steps(steps[name], per_round))
    return {name: statistics.median(t) for name, t in times.items()}


def compare(dropout: float, args: argparse.Namespace) -> dict:
    data = batch(args.batch, 128)
    built = {mode: build(dropout, mode) for mode in MODES}
    mem = {mode: memory(*built[mode], data) for mode in MODES}
    by_module = saved_by_module(built["none"][0], data)
    steps = {mode: step_fn(*built[mode], data) for mode in MODES}
    runs = [alternate(steps, args.rounds, args.steps) for _ in range(args.repeats)]
    runs.sort(key=lambda r: r["full"] / r["none"])
    return {"dropout": dropout, "memory": mem, "runs": runs, "median": runs[len(runs) // 2],
            "by_module": by_module}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    started = time.time()
    results = [compare(dropout, args) for dropout in (0.0, 0.1)]
    summary = run_summary(load, started)
    lines = section(results, summary, args)
    print("\n".join(lines))
    if args.write:
        replace_section("recompute", lines)


def section(results: list[dict], summary: dict, args: argparse.Namespace) -> list[str]:
    shape = models.resolve(models.ModelConfig(arch="llama", preset="llama-tiny"), 256)
    params = sum(p.numel() for p in models.build(shape).parameters())
    lines = [
        "## Activation checkpointing: none, selective, full (dtrain's Llama, one process)",
        "",
        f"Command: `python benchmarks/recompute.py --rounds {args.rounds} --steps "
        f"{args.steps} --repeats {args.repeats} --write`  ",
        f"Date: {summary['date']}. Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}, {args.threads} thread; load average {summary['load_before']:.1f}"
        f" before, {summary['load_after']:.1f} after (shared with other work); "
        f"{summary['minutes']:.1f} min in all.  ",
        f"Model: llama-tiny shape ({params / 1e6:.2f}M parameters, {shape.n_layer} layers, "
        f"width {shape.n_embd}, {shape.n_head}/{shape.n_kv_head} heads, MLP "
        f"{shape.ffn_hidden}), vocabulary 256, {args.batch} x 128 tokens, AdamW. Memory: live "
        "tensor bytes (LiveBytes) above the model and optimizer state; after forward = kept "
        "for backward (with logits and loss); peak = over forward and backward (gradients, "
        f"{4 * params / MiB:.1f} MiB, included). Time: forward, backward, AdamW step; the "
        f"three modes in turns, median of {args.rounds} rounds x {args.steps} steps, the "
        f"comparison repeated {args.repeats} times (the repeat of median full / none shown, "
        "every repeat's ratios in brackets).",
        "",
        "| attention dropout | mode | after forward (MiB) | saved | peak (MiB) | saved | "
        "ms/step | time / none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem, med = r["memory"], r["median"]
        for mode in MODES:
            kept = 1 - mem[mode]["kept"] / mem["none"]["kept"]
            peak = 1 - mem[mode]["peak"] / mem["none"]["peak"]
            ratios = ", ".join(f"{run[mode] / run['none']:.2f}" for run in r["runs"])
            slower = med[mode] / med["none"]
            lines.append(
                f"| {r['dropout']} | {mode} | {mem[mode]['kept'] / MiB:.1f} | "
                f"{'-' if mode == 'none' else f'**{kept:.0%}**'} | "
                f"{mem[mode]['peak'] / MiB:.1f} | {'-' if mode == 'none' else f'{peak:.0%}'} | "
                f"{med[mode] * 1e3:.1f} | "
                f"{'1' if mode == 'none' else f'**{slower:.2f}** ({ratios})'} |")
    lines += ["", "| target (after forward; time) | dropout | saved | time / none | met? |",
              "|---|---|---|---|---|"]
    for mode, saving, slowdown in (("selective", 0.40, 1.15), ("full", 0.75, 1.40)):
        for r in results:
            mem, med = r["memory"], r["median"]
            saved = 1 - mem[mode]["kept"] / mem["none"]["kept"]
            slower = med[mode] / med["none"]
            met = "yes" if saved >= saving and slower <= slowdown + 5e-3 else "no"
            lines.append(f"| {mode}: saves at least {saving:.0%} for at most "
                         f"{slowdown - 1:.0%} more | {r['dropout']} | {saved:.0%} | "
                         f"{slower:.2f} | {met} |")
    lines += ["", "Where the bytes are: what a forward without recomputation keeps for "
              "backward, by the module that keeps it (summed over the blocks; a tensor read "
              "by several modules counts for the first), and what selective recomputes:", "",
              "| kept by | " + " | ".join(f"dropout {r['dropout']} (MiB)" for r in results)
              + " | share | recomputed by selective? |",
              "|---|" + "---|" * len(results) + "---|---|"]
    labels = sorted({k for r in results for k in r["by_module"]},
                    key=lambda k: -max(r["by_module"].get(k, 0) for r in results))
    totals = [sum(r["by_module"].values()) for r in results]
    for label in labels:
        sizes = [r["by_module"].get(label, 0) for r in results]
        share = " / ".join(f"{size / total:.0%}" for size, total in zip(sizes, totals, strict=True))
        recomputed = {"blocks.*.attn.core": "yes: keeps q, k, v",
                      "blocks.*.mlp.act": "yes: keeps gate and up"}.get(label, "")
        lines.append(f"| `{label}` | " + " | ".join(f"{size / MiB:.2f}" for size in sizes)
                     + f" | {share} | {recomputed} |")
    lines.append("| all | " + " | ".join(f"{t / MiB:.2f}" for t in totals) + " | | |")
    plain, dropped = results[0], results[-1]
    lines += [
        "",
        "Selective recomputes the two things above that are large and cheap: the attention "
        "core (with dropout PyTorch's CPU attention takes the math path, which keeps the T x "
        "T probabilities before and after dropout and the mask; without dropout the fused "
        "kernel keeps only q, k, v, its output and a log-sum-exp, which the recomputed core "
        "keeps as well) and SwiGLU's product (it keeps gate, up and silu(gate); recomputed, "
        "gate and up). With dropout that is "
        f"{1 - dropped['memory']['selective']['kept'] / dropped['memory']['none']['kept']:.0%}"
        " of what forward keeps. Without dropout only silu(gate) goes, "
        f"{1 - plain['memory']['selective']['kept'] / plain['memory']['none']['kept']:.0%}:"
        " the rest is inputs that any recomputation short of the whole block must keep "
        "(the norms' and the linears' inputs, the core's q, k, v), so 40% cannot be reached "
        "on this kernel without recomputing matrix products. On a GPU with flash attention "
        "the picture is the dropout-free one at any dropout (flash attention draws the "
        "mask inside the kernel and keeps no T x T tensor), so selective's gain there is "
        "SwiGLU's silu(gate), about one eighth of a Llama block's activations, for one "
        "elementwise kernel; the attention core's recomputation buys nothing there and "
        "costs a flash forward (torchtitan's selective mode chooses by operator instead: it "
        "keeps some matrix products' outputs and recomputes the rest). Selective's time is "
        "the math kernel's softmax and dropout over T x T again, memory-bound on the CPU. "
        "Full recomputation keeps only "
        "each block's input (plus logits and loss); its peak saves less than its kept "
        "bytes because the peak adds the gradients and one block's recomputed activations.",
    ]
    return lines


if __name__ == "__main__":
    main()
