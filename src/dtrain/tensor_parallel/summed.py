"""Replicated parameters' gradients summed over the tensor-parallel group: per parameter
as backward reaches it (`SumOverGroup`: a headwise module's, a column-parallel LoRA
adapter's A), or all in one all-reduce at the end of backward (`SumAtEnd`, Megatron-LM's
all-reduce of the layer norms' gradients).

Under sequence parallelism a parameter every rank holds whole (a norm's weight, a
row-parallel layer's bias) is applied to this rank's part of the sequence only, so its
gradient is that part's; the sum over the group is the whole sequence's. A hook per
parameter would make one small all-reduce each (9 a step for a 4-layer Llama), each
bound by latency. `SumAtEnd` notes each parameter's gradient of this backward as autograd
delivers it, and at the end of backward all-reduces them flattened together and adds to
each `.grad` the other ranks' part (the sum less its own): right under gradient
accumulation, where `.grad` holds earlier backwards' sums already.

DataParallel and ZeRO read `.grad` from hooks while backward goes; they ask
dtrain.data_parallel.late_grads whether a gradient is still to be finished, and finish it
before reading it at their own end of backward.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain import comm
from dtrain.data_parallel import late_grads
from dtrain.errors import DtrainError


class SumOverGroup:
    """A gradient hook: a replicated parameter's gradient from this rank's part of the work
    (its part of the sequence, or its heads), summed over the group into the whole's.
    Every rank's backward reaches the same parameters in the same order, so the
    all-reduces line up."""

    def __init__(self, group: comm.Group, algorithm: str) -> None:
        self.group, self.algorithm = group, algorithm

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(grad.contiguous().clone(), group=self.group,
                               algorithm=self.algorithm)


class SumAtEnd:
    """Sum `params`' gradients over `group` once at the end of each backward (see the
    module's docstring). Registers itself on the parameters; nothing to call."""

    def __init__(self, params: list[nn.Parameter], group: comm.Group, algorithm: str) -> None:
        self.params, self.group, self.algorithm = params, group, algorithm
        self._index = {id(p): k for k, p in enumerate(params)}
        self._own: dict[int, torch.Tensor] = {}  # index -> this backward's gradient here
        for k, p in enumerate(params):
            p.register_hook(self._noter(k))
            late_grads.finish_later(p, self)

    def _noter(self, k: int):
        def note(grad: torch.Tensor) -> None:
            if not self._own:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            before = self._own.get(k)
            self._own[k] = grad if before is None else before + grad

        return note

    def pending(self, param: torch.Tensor) -> bool:
        return self._index.get(id(param)) in self._own

    @torch.no_grad()
    def finish(self) -> None:
        """All-reduce this backward's gradients in one buffer; add the other ranks' part to
        each `.grad`. Every rank of the group reaches the same parameters (the same model),
        so the buffers line up."""
        if not self._own:
            return
        order = sorted(self._own)
        own = [self._own[k].reshape(-1) for k in order]
        self._own = {}
        flat = torch.cat(own)
        summed = comm.all_reduce(flat.clone(), group=self.group, algorithm=self.algorithm)
        others = summed.sub_(flat)
        offset = 0
        for k, mine in zip(order, own, strict=True):
            p = self.params[k]
            part = others[offset: offset + mine.numel()].view_as(p).to(p.dtype)
            offset += mine.numel()
            if p.grad is None:  # a hook took it away: not one of dtrain's strategies
                raise DtrainError(f"a gradient hook took the gradient of a parameter of "
                                   f"shape {tuple(p.shape)} before its sum over tp")
            p.grad.add_(part)
