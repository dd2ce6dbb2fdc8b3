"""One micro-batch of a model traced on fake tensors: live bytes by kind, at named moments,
with a choice of activation recomputation applied.

Every tensor is labelled when it is made (dtrain.planner.traced.tracker) by where the forward or
backward is, as tensor parallelism with sequence parallelism would hold it:

- `SPLIT`: from a column-parallel layer to the next row-parallel one (attention heads, the
  MLP's hidden layer, the vocabulary's logits): every tp rank holds 1/tp of it;
- `SEQ`: after the input part, between a row-parallel layer and the next column-parallel
  one (norms, dropouts, residuals): whole on every tp rank, or 1/tp of the sequence with
  sequence parallelism;
- `WHOLE`: the rest: the input part (embeddings), and each column-parallel layer's input,
  which sequence parallelism gathers whole before the layer (it is what the layer keeps
  for backward, shared by the q, k and v projections reading it).

Backward runs the regions the other way: a row-parallel layer's input gradient is `SPLIT`,
a column-parallel layer's is `SEQ` (its whole-sequence gradient is reduce-scattered at
once). A module recomputed in backward runs its forward again inside backward; that
forward labels its tensors as forward did, and backward's label comes back after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain.planner.traced.tracker import LiveBytes

WHOLE, SPLIT, SEQ = 0, 1, 2
KINDS = 3


class Marks:
    """The label of new tensors, and the bytes of each kind at named moments, less what
    was there before (`held`: the parameters and gradients, model state a layout counts;
    the views forward saves of them are the same memory)."""

    def __init__(self, kind: int = WHOLE, held: object = ()) -> None:
        self.restart(kind, held)

    def restart(self, kind: int = WHOLE, held: object = ()) -> None:
        """Count afresh (a second trace on the same hooks), new tensors labelled `kind`."""
        self.kind = kind
        self.backward = False
        self.tracker = LiveBytes(kind=lambda _: self.kind, kinds=KINDS)
        self.tracker.watch(held)
        self.base = self.tracker.series[-1] if self.tracker.series else (0,) * KINDS
        self.at: dict[str, tuple[int, ...]] = {}

    def _net(self, point: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(a - b for a, b in zip(point, self.base, strict=True))

    def now(self) -> tuple[int, ...]:
        return self._net(self.tracker.series[-1]) if self.tracker.series else (0,) * KINDS

    def mark(self, name: str) -> None:
        self.at[name] = self.now()

    def start_backward(self) -> int:
        """Backward begins now; returns the index in `series` where it does."""
        self.backward = True
        return len(self.tracker.series)

    def peaks_since(self, start: int, end: int | None = None) -> list[tuple[int, ...]]:
        """The moments between two indices of `series` that no other one exceeds in every
        kind: one of them is the peak however tp and sequence parallelism divide them."""
        return [self._net(p) for p in frontier(self.tracker.series[start:end])] or \
            [self.now()]

    def setter(self, kind: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.kind = kind
        return hook

    def gathered(self, module: nn.Module, args: tuple) -> None:
        """A column-parallel layer starts: its input is held whole, its outputs are split."""
        if args and isinstance(args[0], torch.Tensor):
            self.tracker.relabel(args[0], WHOLE)
        self.kind = SPLIT

    def cut(self, module: nn.Module, args: tuple, output: object) -> None:
        """The input part ends: sequence parallelism keeps 1/tp of its output from here."""
        if isinstance(output, torch.Tensor):
            self.tracker.relabel(output, SEQ)
        self.kind = SEQ


def frontier(points: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The points no other point exceeds (or equals) in every coordinate."""
    kept: list[tuple[int, ...]] = []
    for p in sorted(set(points), key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(k, p, strict=True)) for k in kept):
            kept.append(p)
    return kept


def _keep_backward_label(module: nn.Module, marks: Marks) -> None:
    """Wrap `module`'s forward so that, run again in backward (recomputation), it leaves
    backward's label as it found it."""
    forward = module.forward

    def watched(*args: Any, **kwargs: Any) -> Any:
        start = marks.kind
        try:
            return forward(*args, **kwargs)
        finally:  # also when a recomputation stops early, having made what it needed
            if marks.backward:
                marks.kind = start

    module.forward = watched


def watch(model: nn.Module, styles: dict, marks: Marks, cut: nn.Module | None) -> None:
    """Label `model`'s tensors as the module doc says: hooks on its column- and
    row-parallel layers (by `styles`, the tensor-parallel plan's matches), on `cut` (the
    module making the first block's input; None: no input part), and a wrapper on every
    module's forward for recomputation. Call it before activation checkpointing is
    applied, which then recomputes the wrapped forwards."""
    from dtrain.tensor_parallel.parallelize import Colwise, Rowwise

    for name, module in model.named_modules():
        style = styles.get(name)
        if isinstance(style, Colwise):
            module.register_forward_pre_hook(marks.gathered)
            module.register_full_backward_pre_hook(marks.setter(SEQ))
        elif isinstance(style, Rowwise):
            module.register_forward_pre_hook(marks.setter(SEQ))
            module.register_full_backward_pre_hook(marks.setter(SPLIT))
        if not isinstance(module, nn.ModuleList | nn.ModuleDict):
            _keep_backward_label(module, marks)
    if cut is not None:
        cut.register_forward_hook(marks.cut)
