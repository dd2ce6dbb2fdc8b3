"""Cutting a model's layers into contiguous pipeline stages of balanced cost.

    sizes = balanced_sizes([cost of each block], parts)   # minimizes the costliest stage
    pieces = split(nn.Sequential(...), parts, balance="params" | "time" | [sizes])

A stage is a run of consecutive layers; the cost of the slowest stage sets the pipeline's
pace, so the split minimizes the largest per-stage sum (exactly, by dynamic programming).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from dtrain.errors import ConfigError


def balanced_sizes(costs: Sequence[float], parts: int, first: float = 0.0,
                   last: float = 0.0) -> list[int]:
    """Sizes of `parts` contiguous groups of `costs` whose largest sum is smallest, the
    first group's sum counting `first` more and the last's `last` more (a model's input
    and output parts, beside its blocks).

    Raises:
        ConfigError: more parts than items.
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise ConfigError(f"cannot cut {n} layers into {parts} pipeline stages: use at most "
                          f"{n} stages (pp x virtual stages), or a model with more layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i items in k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            extra = (first if k == 1 else 0.0) + (last if k == parts else 0.0)
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def measured_costs(layers: Sequence[nn.Module], sample: torch.Tensor,
                   repeats: int = 3) -> list[float]:
    """Forward + backward seconds of each layer on `sample` (passed through the layers in
    turn), the median of `repeats` runs."""
    costs = []
    x = sample
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.float().sum().backward()
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach()
    return costs


def stage_sizes(layers: Sequence[nn.Module], parts: int, balance: str | Sequence[int] = "params",
                sample: torch.Tensor | None = None) -> list[int]:
    """How many consecutive layers each of `parts` stages takes.

    `balance`: "params" (parameter counts), "time" (measured on `sample`; measure on one
    rank and share the result, so every rank cuts the same way), or explicit sizes.

    Raises:
        ConfigError: explicit sizes that do not add up, too many stages, or an unknown
            balance.
    """
    if not isinstance(balance, str):
        sizes = list(balance)
        if len(sizes) != parts or sum(sizes) != len(layers) or min(sizes) < 1:
            raise ConfigError(f"balance={sizes} must be {parts} positive sizes adding up to "
                              f"the {len(layers)} layers")
        return sizes
    if balance == "params":
        costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    elif balance == "time":
        if sample is None:
            raise ConfigError('balance="time" needs a sample input to time the layers on')
        costs = measured_costs(layers, sample)
    else:
        raise ConfigError(f"balance={balance!r}: use 'params', 'time' or a list of sizes")
    return balanced_sizes(costs, parts)


def split(model: nn.Sequential | Sequence[nn.Module], parts: int,
          balance: str | Sequence[int] = "params",
          sample: torch.Tensor | None = None) -> list[nn.Sequential]:
    """Cut `model` into `parts` nn.Sequential pieces of consecutive layers, keeping each
    layer's name (so a piece's state_dict keys are the whole model's)."""
    named = (list(model.named_children()) if isinstance(model, nn.Sequential)
             else [(str(i), layer) for i, layer in enumerate(model)])
    sizes = stage_sizes([layer for _, layer in named], parts, balance, sample)
    pieces, start = [], 0
    for size in sizes:
        pieces.append(nn.Sequential(OrderedDict(named[start : start + size])))
        start += size
    return pieces
