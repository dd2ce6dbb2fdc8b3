"""Gradient buckets: parameters packed into flat buffers that are communicated as one.

One collective per parameter pays the per-message latency dozens of times a step; one
collective for the whole model cannot start until backward ends. Buckets of a few MB are
the middle road (Li et al., "PyTorch Distributed", VLDB 2020): a bucket is sent as soon as
all its gradients exist, while backward keeps computing the rest.

Parameters are assigned in reverse registration order, which approximates the order in
which backward produces their gradients (DataParallel repacks them in the order its first
backward saw). Some gradients come in bursts: a block compiled with torch.compile returns
all its parameters' gradients at the end of its backward (dtrain.models.compiled
`gradients_together`). A bucket is then cut between bursts, never inside one: a bucket
that held the last blocks and a part of the next would wait for that next block's whole
backward, and the bucket holding most of a model and a part of its first block would start
only when backward has ended, with nothing left to hide it. Nor does a bucket hold two
bursts: the earlier block's gradients would wait a block's backward for the later's.

Each bucket's buffer ends with one *presence flag* per parameter (1 where this rank
produced that gradient), reduced together with the gradients: after a sum, a flag of 0
means no rank used the parameter this step.

A bucket's buffer is allocated the first time it is used (the first backward's first
gradient for it), not when the buckets are packed: the gradients' memory is made during
backward, as one process makes it, so a model being built holds only its parameters.
(DDP allocates its buckets in its constructor, torch/csrc/distributed/c10d/reducer.cpp
`initialize_buckets`.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    burst: Callable[[nn.Parameter], int | None] | None = None,
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
            overlap backward (it starts when backward ends) is short; default none. The
            last burst (the first compiled block's gradients, which come at the end of
            backward) goes to the last buckets whole, however large: the bucket before
            must not wait for it.
        apart: a bucket never mixes parameters for which this says True with others
            (they are reduced over another group: split experts).
        burst: consecutive parameters with the same key here (not None) get their
            gradients at once (a compiled block's, `gradients_together`): a bucket is cut
            before such a burst rather than inside it, unless the burst alone is over
            the cap.
    """
    def nbytes(p: nn.Parameter) -> int:
        return _nbytes(p, grad_dtype)

    def kind(p: nn.Parameter) -> Hashable:
        return p.device, p.dtype, apart is not None and apart(p)

    tail = len(params)
    if last_bytes is not None:
        total = 0
        while tail > 1 and total + nbytes(params[tail - 1]) <= last_bytes:
            tail -= 1
            total += nbytes(params[tail])
        while 0 < tail < len(params) and _same_burst(burst, params[tail - 1], params[tail]):
            tail -= 1  # a cut inside a burst moves to its start
        tail = min(tail, _last_burst(params, burst))
        head = sum(nbytes(p) for p in params[:tail])
        if tail == len(params) or head <= (first_bytes or 0):
            tail = len(params)  # nothing fits apart, or the rest is the first bucket anyway
    groups = cut(params[:tail], bucket_bytes, nbytes, kind, burst, first_bytes)
    groups += cut(params[tail:], bucket_bytes, nbytes, kind, burst)
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


_T = TypeVar("_T")  # what is cut into runs: parameters, or (name, tensor) pairs


def _same_burst(burst: Callable[[_T], int | None] | None, a: _T, b: _T) -> bool:
    """Whether `a` and `b` get their gradients in one burst (see `cut`)."""
    if burst is None:
        return False
    key = burst(a)
    return key is not None and key == burst(b)


def _last_burst(items: Sequence[_T], burst: Callable[[_T], int | None] | None) -> int:
    """Where the last burst of `items` starts (len(items) when there is none)."""
    keyed = [k for k, item in enumerate(items) if burst is not None and burst(item) is not None]
    if not keyed:
        return len(items)
    start = keyed[-1]
    while start and _same_burst(burst, items[start - 1], items[start]):
        start -= 1
    return start


def cut(items: Sequence[_T], cap: int, nbytes: Callable[[_T], int],
        kind: Callable[[_T], Hashable], burst: Callable[[_T], int | None] | None = None,
        first_cap: int | None = None) -> list[list[_T]]:
    """`items` in order, cut into consecutive runs of about `cap` bytes (`first_cap` for
    the first), each of one `kind` (device, dtype, ...); an item over the cap gets a run
    of its own. Consecutive items of one `burst` key (gradients that come at once: a
    compiled block's) start a run of their own, cut like single items if the burst alone
    is over the cap; items after a burst may join its run. A burst never joins the run
    before it: that run would wait for the burst, a whole block's backward later, where
    alone it goes out as soon as its block's backward ends (FSDP2 under torchtitan's
    regional compile likewise reduces one block at a time)."""
    def cap_of(run: int) -> int:
        return first_cap if run == 0 and first_cap is not None else cap

    runs: list[list[_T]] = []
    size = start = 0
    while start < len(items):
        end = start + 1
        while end < len(items) and _same_burst(burst, items[start], items[end]) \
                and kind(items[end]) == kind(items[start]):
            end += 1
        whole = sum(nbytes(item) for item in items[start:end])
        bursting = burst is not None and burst(items[start]) is not None
        if runs and not bursting and size + whole <= cap_of(len(runs) - 1) \
                and kind(runs[-1][0]) == kind(items[start]):
            runs[-1] += items[start:end]
            size += whole
        elif whole <= cap_of(len(runs)) or end - start == 1:
            runs.append(list(items[start:end]))
            size = whole
        else:
            runs.append([items[start]])
            size = nbytes(items[start])
            for item in items[start + 1 : end]:
                if size + nbytes(item) > cap_of(len(runs) - 1):
                    runs.append([])
                    size = 0
                runs[-1].append(item)
                size += nbytes(item)
        start = end
    return runs


def launch_ready(items: Sequence[Any], start: int, launch: Callable[[Any], None]) -> int:
    """Launch the collective of each of `items[start:]` (buckets, ZeRO units) in order,
    stopping at the first whose gradients are still `pending`; returns the index of the
    next to launch. Strict order makes every rank issue the same sequence of collectives,
    even when ranks use different parameters."""
    while start < len(items) and not items[start].pending:
        launch(items[start])
        start += 1
    return start
