"""Gradient buckets: parameters packed into flat buffers that are communicated as one.

One collective per parameter pays the per-message latency dozens of times a step; one
collective for the whole model cannot start until backward ends. Buckets of a few MB are
the middle road (Li et al., "PyTorch Distributed", VLDB 2020): a bucket is sent as soon as
all its gradients exist, while backward keeps computing the rest.

Parameters are assigned in reverse registration order, which approximates the order in
which backward produces their gradients. Each bucket's buffer ends with one *presence
flag* per parameter (1 where this rank produced that gradient), reduced together with the
gradients: after a sum, a flag of 0 means no rank used the parameter this step.

A bucket's buffer is allocated the first time it is used (the first backward's first
gradient for it), not when the buckets are packed: the gradients' memory is made during
backward, as one process makes it, so a model being built holds only its parameters.
(DDP allocates its buckets in its constructor, torch/csrc/distributed/c10d/reducer.cpp
`initialize_buckets`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Bucket:
    """A group of parameters whose gradients travel in one flat buffer of `dtype`
    (allocated on first use, see `buffer`)."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    present: list[int] = field(default_factory=list)  # flags, written into the buffer at once

    def __post_init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        self.reset()

    @property
    def allocated(self) -> bool:
        """Whether the buffer exists yet (it does from the first backward on)."""
        return self._buffer is not None

    @property
    def buffer(self) -> torch.Tensor:
        """`numel` gradient elements, then one presence flag per parameter (allocated as
        zeros on the parameters' device the first time it is asked for)."""
        if self._buffer is None:
            self._allocate()
        assert self._buffer is not None  # made by _allocate
        return self._buffer

    @property
    def slots(self) -> list[torch.Tensor]:
        """Each parameter's view of the buffer, shaped like it (allocates the buffer)."""
        if self._buffer is None:
            self._allocate()
        return self._slots

    def _allocate(self) -> None:
        self._buffer = torch.zeros(self.numel + len(self.params), dtype=self.dtype,
                                   device=self.params[0].device)
        # each parameter's view of the buffer, made once: backward's hooks write into them
        self._slots = [self._buffer[o : o + p.numel()].view_as(p)
                       for p, o in zip(self.params, self.offsets, strict=True)]

    def reset(self) -> None:
        """Forget which gradients arrived; called after every synchronized backward."""
        self.ready = [False] * len(self.params)
        self.present = [0] * len(self.params)
        self.pending = len(self.params)

    def write_flags(self) -> None:
        """Put the presence flags into the buffer (one copy), before it is reduced."""
        self.flags.copy_(torch.tensor(self.present, dtype=self.buffer.dtype))

    @property
    def flags(self) -> torch.Tensor:
        """Presence flags, one per parameter, after the gradients in the buffer."""
        return self.buffer[self.numel :]

    @property
    def grads(self) -> torch.Tensor:
        """All gradient elements of the bucket, flat."""
        return self.buffer[: self.numel]


def build_buckets(
    params: list[nn.Parameter], bucket_bytes: int, grad_dtype: torch.dtype | None,
    first_bytes: int | None = None, last_bytes: int | None = None,
    apart: Callable[[nn.Parameter], bool] | None = None,
) -> list[Bucket]:
    """Pack `params` (in the given order) into buckets of about `bucket_bytes` each (their
    buffers are allocated when first used).

    A bucket never mixes devices or parameter dtypes, and a parameter larger than the cap
    gets a bucket of its own.

    Args:
        params: parameters in the order their gradients are expected.
        bucket_bytes: cap on a bucket's gradient bytes (in the communication dtype).
        grad_dtype: dtype of the communicated gradients; None keeps each parameter's dtype.
        first_bytes: a smaller cap for the first bucket, so that communication starts
            early in backward (DDP's first bucket is 1 MB); default `bucket_bytes`.
        last_bytes: a smaller cap for the last: the parameters at the end of `params`
            that fit in it are packed on their own, so the one collective that cannot
            overlap backward (it starts when backward ends) is short; default none.
        apart: a bucket never mixes parameters for which this says True with others
            (they are reduced over another group: split experts).
    """
    tail = len(params)
    if last_bytes is not None:
        total = 0
        while tail > 1 and total + _nbytes(params[tail - 1], grad_dtype) <= last_bytes:
            tail -= 1
            total += _nbytes(params[tail], grad_dtype)
        head = sum(_nbytes(p, grad_dtype) for p in params[:tail])
        if tail == len(params) or head <= (first_bytes or 0):
            tail = len(params)  # nothing fits apart, or the rest is the first bucket anyway
    groups = _groups(params[:tail], bucket_bytes, grad_dtype, first_bytes, apart)
    groups += _groups(params[tail:], bucket_bytes, grad_dtype, None, apart)
    buckets = []
    for index, group in enumerate(groups):
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        buckets.append(Bucket(index, group, offsets, total, grad_dtype or group[0].dtype))
    return buckets


def _nbytes(p: nn.Parameter, grad_dtype: torch.dtype | None) -> int:
    """Bytes of `p`'s gradient in a bucket (in `grad_dtype`, else p's own)."""
    return p.numel() * (grad_dtype or p.dtype).itemsize


def _groups(params: list[nn.Parameter], bucket_bytes: int, grad_dtype: torch.dtype | None,
            first_bytes: int | None, apart: Callable[[nn.Parameter], bool] | None
            ) -> list[list[nn.Parameter]]:
    """`params` in order, cut into groups as `build_buckets` describes."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = _nbytes(p, grad_dtype)
        current = groups[-1] if groups else None
        cap = first_bytes if len(groups) == 1 and first_bytes is not None else bucket_bytes
        fits = current is not None and size + nbytes <= cap
        same_kind = current is not None and (
            current[0].device == p.device and current[0].dtype == p.dtype
            and (apart is None or apart(current[0]) == apart(p))
        )
        if current is not None and fits and same_kind:
            current.append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups


def launch_ready(items: Sequence[Any], start: int, launch: Callable[[Any], None]) -> int:
    """Launch the collective of each of `items[start:]` (buckets, ZeRO units) in order,
    stopping at the first whose gradients are still `pending`; returns the index of the
    next to launch. Strict order makes every rank issue the same sequence of collectives,
    even when ranks use different parameters."""
    while start < len(items) and not items[start].pending:
        launch(items[start])
        start += 1
    return start
