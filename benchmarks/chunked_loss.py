"""The chunked loss against the plain one (`[train] loss`): peak memory and step time of
dtrain's Llama at vocabularies of 32K and 128K, side by side in one run.

    python benchmarks/chunked_loss.py [--rows 2 --tokens 1024 --rounds 5 --write]

One process, a small Llama (2 layers, width 64: the head and the loss are most of the
step, as they are of a large-vocabulary model's last stage) on `rows` x `tokens` tokens,
SGD. Three losses on the same model and batch: "plain" (the logits of every token at
once), "chunked" by the default 1024 tokens, and chunked by 256
(dtrain.models.chunked_loss.apply).

Memory (dtrain.planner.LiveBytes: live tensor bytes, the CPU's max_memory_allocated,
counted op by op, so the same on a busy machine): the model exists before the tracker
starts, so its peak is the step's own: activations, logits (plain) or one chunk's
(chunked), and the gradients (the 128K embedding's and head's included, 2 x 32 MiB).
Time: forward, backward, SGD step, zero_grad; the three losses take turns in rounds (the
order reversed every round) so the machine's noise hits them alike; the median over
rounds. The losses agree (tests/models/test_chunked_loss.py checks it).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch
from dp_vs_ddp import step_fn
from recompute import alternate
from results_md import replace_section, run_summary

from dtrain import models
from dtrain.models.chunked_loss import DEFAULT_CHUNK, apply
from dtrain.planner import LiveBytes

VOCABULARIES = (32768, 128256)
LOSSES = {"plain": 0, f"chunked {DEFAULT_CHUNK}": DEFAULT_CHUNK, "chunked 256": 256}
"""Name -> tokens per chunk (0: the plain loss)."""
MiB = 2**20
SHAPE = {"arch": "llama", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2,
         "ffn_hidden": 176, "tie_embeddings": False}


def build(vocab: int, chunk: int, block: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The small Llama at `vocab`, its loss plain (`chunk` 0) or chunked by `chunk`."""
    torch.manual_seed(0)
    model = models.build(models.resolve(models.ModelConfig(**SHAPE, block_size=block), vocab))
    apply(model, "chunked" if chunk else "plain", chunk or DEFAULT_CHUNK)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def peak_bytes(step: Callable[[], None]) -> int:
    """The live tensor bytes' peak over one step."""
    tracker = LiveBytes()
    with tracker:
        step()
    return tracker.peak


def compare(vocab: int, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(1)
    data = (torch.randint(0, vocab, (args.rows, args.tokens), generator=g),
            torch.randint(0, vocab, (args.rows, args.tokens), generator=g))
    steps = {name: step_fn(*build(vocab, chunk, args.tokens), data)
             for name, chunk in LOSSES.items()}
    return {"vocab": vocab, "memory": {name: peak_bytes(step) for name, step in steps.items()},
            "time": alternate(steps, args.rounds, per_round=1, warmup=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load, started = os.getloadavg()[0], time.time()
    results = [compare(vocab, args) for vocab in VOCABULARIES]
    summary = run_summary(load, started)
    lines = section(results, summary, args)
    print("\n".join(lines))
    if args.write:
        replace_section("chunked_loss", lines)


def section(results: list[dict], summary: dict, args: argparse.Namespace) -> list[str]:
    tokens = args.rows * args.tokens
    lines = [
        "## Chunked loss: peak memory and step time against the plain loss (dtrain's Llama)",
        "",
        f"Command: `python benchmarks/chunked_loss.py --rows {args.rows} --tokens "
        f"{args.tokens} --rounds {args.rounds} --write`  ",
        f"Date: {summary['date']}. Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}, {args.threads} thread; load average {summary['load_before']:.1f}"
        f" before, {summary['load_after']:.1f} after; {summary['minutes']:.1f} min in all.  ",
        f"Model: Llama, {SHAPE['n_layer']} layers, width {SHAPE['n_embd']}, untied head; "
        f"{args.rows} x {args.tokens} = {tokens} tokens a step, SGD. Peak: live tensor "
        "bytes over forward, backward and the step (LiveBytes; the model's own excluded, "
        "its gradients included); the fp32 logits of the step's tokens shown beside. Time: "
        f"median of {args.rounds} rounds, the losses in turns.",
        "",
        "| vocabulary | loss | peak (MiB) | peak / plain | logits (MiB) | ms/step | "
        "time / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem, times = r["memory"], r["time"]
        logits = tokens * r["vocab"] * 4 / MiB
        for name in LOSSES:
            smaller, slower = mem[name] / mem["plain"], times[name] / times["plain"]
            lines.append(
                f"| {r['vocab']} | {name} | {mem[name] / MiB:.0f} | "
                f"{'1' if name == 'plain' else f'**{smaller:.2f}**'} | "
                f"{logits:.0f} | {times[name] * 1e3:.0f} | "
                f"{'1' if name == 'plain' else f'{slower:.2f}'} |")
    big = results[-1]
    lines += ["", "| target | loss | peak / plain | met? |", "|---|---|---|---|"]
    for name in LOSSES:
        if name != "plain":
            ratio = big["memory"][name] / big["memory"]["plain"]
            lines.append(f"| chunked peak at {big['vocab']} <= 0.3 x plain | {name} | "
                         f"{ratio:.2f} | {'yes' if ratio <= 0.3 else 'no'} |")
    lines += [
        "",
        "What stays in the chunked peak: the gradients of the embedding and the head "
        "(V x width each), the hidden states' gradient (tokens x width), and one chunk's "
        "logits (chunk x V fp32, their softmax and gradient made in place); the plain peak "
        "holds every token's logits, their log-softmax and their gradient. So the ratio "
        "falls as the tokens per step grow past the chunk: at 4 x 8192 tokens and a 128K "
        "vocabulary the plain loss's logits alone are 16 GiB, a 1024-token chunk's 0.5 GiB. "
        "The chunked loss multiplies the head three times per step as the plain one does "
        "(the gradients are made in forward, not the logits again in backward), so its time "
        "is the plain loss's plus the chunks' smaller products and Python loop.",
    ]
    return lines


if __name__ == "__main__":
    main()
