"""Regional compilation: each transformer block compiled on its own with torch.compile.

    compile_blocks(model)                 # every block of dtrain's GPT, Llama, an HF model
    compile_blocks(model, backend="aot_eager")   # traced, not code-generated (debugging)

The blocks of a language model are the same code with different weights, so the compiler
traces one block, generates its kernels once, and every other block reuses them: the cost
of compiling is one block's, not the whole model's (torchtitan compiles the same way). The
block's forward is replaced on the instance, as recomputation does (dtrain.models.recompute),
and never the module's call: the hooks that layouts put on a block stay outside the
compiled region and run eagerly. ZeRO-3 gathers a block's parameters in a forward pre-hook
and frees them after; DataParallel's and ZeRO's gradient hooks fire when the compiled
backward has produced the block's gradients. Module names, and so checkpoints and plans, are
unchanged.

A compiled block's backward is one graph (AOTAutograd's), which returns all the block's
parameter gradients at its end: eager autograd makes each as its own operation finishes,
spread over the block's backward, but compiled they come in one burst
(`gradients_together`). A strategy that sends gradients while backward goes cuts its
buckets between blocks, never inside one (DataParallel's buckets, ZeRO's units): a bucket
holding part of a block waits for that block's whole backward, and the bucket that held
most of the model and a part of the first block started only when backward had ended,
with nothing left to hide it. For the same reason ZeRO-3 prefetches the next block's
parameters as a compiled block's backward starts, not at its first gradient (its last).

What the compiler cannot trace (a collective inside tensor or context parallelism's
autograd functions, a MoE layer's data-dependent routing) is a graph break: that call runs
eagerly between two compiled regions, with the same result. Recomputation wraps a compiled
block's forward (compile first, then `dtrain.models.recompute`): backward runs the compiled
forward again.

Compiled kernels are cached on disk (`cache_dir`), so a restart of the same job loads them
instead of generating them again.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dtrain.models.stages import block_lists

_COMPILED = "_dtrain_compiled_forward"  # instance attribute: the forward before compiling
_BLOCKS_FIX = ("train.compile", "compile its blocks with torch.compile yourself, or keep "
               "them in an nn.ModuleList")
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its compiled kernels (and the FX graph cache under it)."""


def compile_blocks(model: nn.Module, backend: str = "inductor",
                   cache_dir: str | Path | None = None) -> list[str]:
    """Compile each transformer block of `model` on its own (the blocks `model.stage_parts()`
    names for a `Stages` model, else every element of every nn.ModuleList): its forward is
    replaced on the instance by the compiled one. Applying it again changes nothing.

    `cache_dir`, if given and no cache is chosen already (env TORCHINDUCTOR_CACHE_DIR
    naming another folder than inductor's default), is where compiled kernels are kept
    between runs. Returns the names of the blocks.

    Raises:
        ConfigError: the model keeps no blocks in an nn.ModuleList.
    """
    if cache_dir is not None and not _cache_chosen():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = str(Path(cache_dir).resolve())
    names = []
    for list_name in block_lists(model, _BLOCKS_FIX):
        blocks = cast(nn.ModuleList, model.get_submodule(list_name))  # what block_lists names
        for index, block in enumerate(blocks):
            names.append(f"{list_name}.{index}")
            if not is_compiled(block):
                # a bound method: its function, taking the block first
                forward = block.forward.__func__  # type: ignore[attr-defined]
                setattr(block, _COMPILED, forward)
                block.forward = types.MethodType(_compiled(forward, backend), block)
    return names


def _cache_chosen() -> bool:
    """Whether someone chose inductor's cache: the environment names one other than the
    default, which inductor writes into the environment itself when it first looks."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(CACHE_ENV)
    return chosen is not None and os.path.abspath(chosen) != os.path.abspath(
        default_cache_dir())


def is_compiled(module: nn.Module) -> bool:
    """Whether `compile_blocks` compiled `module`'s forward."""
    return _COMPILED in vars(module)


def gradients_together(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable parameters of each block of `model` that `compile_blocks` compiled,
    block by block (forward order): backward gives each list its gradients at once, at the
    end of the block's compiled backward (see the module docstring). A parameter of two
    blocks (tied) is left out: its gradient is whole only after both. Empty for a model
    with no compiled block."""
    blocks = [m for m in model.modules() if is_compiled(m)]
    owners: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for p in block.parameters():
            owners[id(p)] = k if owners.get(id(p), k) == k else -1
    together = [[p for p in block.parameters() if p.requires_grad and owners[id(p)] == k]
                for k, block in enumerate(blocks)]
    return [params for params in together if params]


_SHARED: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}


def _compiled(forward: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """`forward` (a function taking the block first) compiled: one compiled function for
    every block of a kind, so that they share its traced graphs and kernels. A deep copy of
    the model binds it to the copy, as it binds the class's forward."""
    key = (forward, backend)
    if key not in _SHARED:
        _SHARED[key] = torch.compile(forward, backend=backend)
    return _SHARED[key]


def compile_stats() -> dict[str, float]:
    """What dynamo did in this process so far: frames compiled (`frames`; a recompilation
    counts again), graph breaks (`breaks`), seconds spent compiling (`seconds`), and graphs
    whose kernels came from the on-disk cache instead of code generation (`cached`:
    inductor's FX graph cache hits). A steady run compiles nothing more after its first
    step."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"frames": counters["frames"].get("ok", 0),
            "breaks": sum(counters["graph_break"].values()),
            "seconds": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
            "cached": counters["inductor"].get("fxgraph_cache_hit", 0)}


def report(stats: dict[str, float]) -> str:
    """The progress line for `compile_stats()` after a run's first step."""
    graphs = int(stats["frames"])
    cached = f" ({int(stats['cached'])} from the cache)" if stats["cached"] else ""
    return (f"compile: {stats['seconds']:.1f} s in the first step; {graphs} "
            f"graph{'s' if graphs != 1 else ''}{cached}, {int(stats['breaks'])} graph breaks; "
            f"kernels cached in {os.environ.get(CACHE_ENV, 'the default cache')}")
