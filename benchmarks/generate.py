"""Generation tokens/s: dtrain's GPT split tp=2 over 2 ranks against one process holding
it whole, both through the KV cache, and one process without the cache (the path
`dtrain train`'s sample took before: the whole prefix re-run for every token).

    dtrain run -n 2 benchmarks/generate.py

Each round generates TOKENS tokens after a PROMPT-token prompt, three ways in turn: tp=2
(dtrain.train.generation.generate_split: both ranks), then rank 0 alone with the whole
model with and without the cache while rank 1 waits. The median of ROUNDS rounds is
printed as a Markdown table; the three texts are checked equal.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

import dtrain
from dtrain import comm, layouts
from dtrain.config import dims_of, load_config
from dtrain.mesh import Mesh
from dtrain.models import generate as gen
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.train.generation import generate_split

SHAPE = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_embd=512)
PROMPT, TOKENS, ROUNDS = 16, 128, 3


def _uncached(model: torch.nn.Module, idx: torch.Tensor, generator: torch.Generator
              ) -> torch.Tensor:
    """The whole prefix re-run for every token (generate without a KV cache)."""
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(idx[:, -SHAPE.block_size:])[:, -1, :]
            idx = torch.cat([idx, gen.pick_token(logits, generator, 0.8)], dim=1)
    return idx


def main() -> None:
    world = dtrain.init()
    torch.manual_seed(0)
    model = GPT(SHAPE).eval()
    whole = copy.deepcopy(model)
    config = load_config(None, ["parallel.nproc=2", "parallel.tp=2", "train.batch_size=2"])
    mesh = Mesh(dims_of(config, world.world_size))
    held = layouts.build(model, mesh, config)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"tp=2, KV cache": [], "one process, KV cache": [],
                                     "one process, no cache": []}
    texts: dict[str, list[int]] = {}
    for _ in range(ROUNDS):
        comm.barrier()
        start = time.perf_counter()
        texts["tp=2, KV cache"] = generate_split(held, model, mesh, prompt.tolist(), TOKENS,
                                                seed=0, temperature=0.8, vocab_size=256)
        times["tp=2, KV cache"].append(time.perf_counter() - start)
        if world.rank == 0:
            start = time.perf_counter()
            out = gen.generate(whole, prompt[None], TOKENS, SHAPE.block_size,
                               generator=torch.Generator().manual_seed(0))
            times["one process, KV cache"].append(time.perf_counter() - start)
            texts["one process, KV cache"] = out[0].tolist()
            start = time.perf_counter()
            out = _uncached(whole, prompt[None], torch.Generator().manual_seed(0))
            times["one process, no cache"].append(time.perf_counter() - start)
            texts["one process, no cache"] = out[0].tolist()
        comm.barrier()
    if world.rank == 0:
        same = len({tuple(t) for t in texts.values()}) == 1
        base = statistics.median(times["one process, KV cache"])
        print(f"GPT {SHAPE.n_layer} layers, width {SHAPE.n_embd}, {SHAPE.n_head} heads; "
              f"{TOKENS} tokens after {PROMPT}; median of {ROUNDS}; same text: {same}; "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| generation | tokens/s | vs one process with the cache |")
        print("|---|---|---|")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"| {name} | {TOKENS / median:.0f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
