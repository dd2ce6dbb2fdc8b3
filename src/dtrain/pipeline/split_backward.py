"""A stage's backward in two parts: B, the gradient of its input, and W, its weights'.

A zero-bubble schedule (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") runs B as
soon as it can, since the stage before waits for the input's gradient, and W later, in
what would be a bubble, since nobody waits for it. Autograd computes both in one pass;
`WeightGrads.install(piece)` makes each of the piece's linear products an autograd
function whose backward computes the input's gradient dX = dY W at once and, inside
`deferring(micro)`, keeps the product's input X and output gradient dY instead of
computing dW = dY^T X and db = sum dY (the only tensors W needs: the rest of the
micro-batch's activations are freed by B). `run(micro)` then computes every kept weight
gradient of that micro-batch and accumulates them in one autograd call on the parameters
themselves, so hooks that reduce gradients as they come (DataParallel, ZeRO) see them as
they would in one backward.

What is split: the products of nn.Linear layers (LoRA's factors among them) and of the
tensor-parallel layers (`ColumnParallelLinear`, `RowParallelLinear`: their collectives
stay in B, only the local product's weight gradient moves to W). Everything else (norms,
embeddings, a mixture of experts' grouped experts, a column-parallel layer under sequence
parallelism, whose product keeps only its part of the input) computes its weight
gradients in B. A recomputed block (activation checkpointing) is recomputed once, in B,
and keeps its products' inputs for W as any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from dtrain.adapters.lora import LoRAFactor
from dtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

Kept = tuple[nn.Parameter | None, nn.Parameter | None, torch.Tensor, torch.Tensor]
"""(weight, bias, X, dY) of one product whose weight gradients wait for W."""


def weight_grads(x: torch.Tensor, dy: torch.Tensor, weight: bool, bias: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW = dY^T X and db = sum of dY over the tokens, of a product y = x W^T + b."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (dy2.t().mm(x2) if weight else None), (dy2.sum(0) if bias else None)


class _SplitCtx(FunctionCtx):
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    keeper: WeightGrads
    params: tuple[nn.Parameter, nn.Parameter | None]


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b, whose backward gives dX at once and dW, db now or, while its keeper
    defers, at W."""

    @staticmethod
    def forward(ctx: _SplitCtx, x: torch.Tensor, weight: nn.Parameter,
                bias: nn.Parameter | None, keeper: WeightGrads) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.keeper, ctx.params = keeper, (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: _SplitCtx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        dx = dy.matmul(weight.to(dy.dtype)) if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return dx, None, None, None
        if ctx.keeper.keep(weight if want_w else None, bias if want_b else None, x, dy):
            return dx, None, None, None
        dw, db = weight_grads(x, dy, want_w, want_b)
        return dx, dw, db, None


class WeightGrads:
    """The split backward of one pipeline piece (see the module doc)."""

    def __init__(self) -> None:
        self.kept: dict[int, list[Kept]] = {}
        self.installed = 0  # the products it splits
        self._micro: int | None = None
        self._plain = False

    @classmethod
    def install(cls, piece: nn.Module) -> WeightGrads:
        """A keeper for `piece`, whose linear products it now splits (in place)."""
        keeper = cls()
        for module in piece.modules():
            if isinstance(module, nn.Linear) and type(module) in (nn.Linear, LoRAFactor):
                module.forward = keeper._linear_forward(module)  # type: ignore[method-assign, assignment]
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)) \
                    and module.matmul is F.linear:
                module.matmul = keeper.linear
            else:
                continue
            keeper.installed += 1
        return keeper

    def _linear_forward(self, module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return self.linear(x, module.weight, module.bias)

        return forward

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear, split (see the module doc)."""
        if self._plain or not torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        return _SplitLinear.apply(x, weight, bias, self)

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """Inside, the products are autograd's own: for a micro-batch whose W comes right
        after its B (one backward computes both), forward and any recomputation in it."""
        self._plain = True
        try:
            yield
        finally:
            self._plain = False

    @contextlib.contextmanager
    def deferring(self, micro: int) -> Iterator[None]:
        """Inside, the backward of micro-batch `micro` keeps the weight gradients for
        `run(micro)` (B); outside, backward computes them as usual."""
        self._micro = micro
        self.kept.setdefault(micro, [])
        try:
            yield
        finally:
            self._micro = None

    def keep(self, weight: nn.Parameter | None, bias: nn.Parameter | None, x: torch.Tensor,
             dy: torch.Tensor) -> bool:
        """Keep a product's weight gradients for W if deferring; whether it kept them."""
        if self._micro is None:
            return False
        self.kept[self._micro].append((weight, bias, x, dy))
        return True

    @torch.no_grad()
    def _grads(self, micro: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, bias, x, dy in self.kept.pop(micro, []):
            dw, db = weight_grads(x, dy, weight is not None, bias is not None)
            for param, grad in ((weight, dw), (bias, db)):
                if param is None or grad is None:
                    continue
                before = summed.get(id(param))
                summed[id(param)] = (param, grad.to(param.dtype) if before is None
                                     else before[1] + grad.to(param.dtype))
        return [p for p, _ in summed.values()], [g for _, g in summed.values()]

    def run(self, micro: int) -> None:
        """W of micro-batch `micro`: its kept weight gradients, accumulated into the
        parameters by autograd (their gradient hooks run as in any backward)."""
        params, grads = self._grads(micro)
        if params:
            torch.autograd.backward(params, grads)

    def pending(self) -> int:
        """Micro-batches whose W is still to run."""
        return len(self.kept)
