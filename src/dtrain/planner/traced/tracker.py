"""Live tensor bytes, measured op by op: the peak memory of real runs and of traced ones.

`LiveBytes` is a dispatch mode: every tensor an operation returns has its storage noted
(once, weakly), and after every operation the bytes of all noted storages still alive are
summed. Storages resized in place (ZeRO-3 frees gathered parameters so) are counted at
their current size. On CUDA, `torch.cuda.max_memory_allocated` gives the same figure; on
the CPU there is no allocator statistic, and this is the equivalent: bytes of live tensors,
not the process's resident memory (the Python interpreter, libraries and the allocator's
cache are left out).

Under `FakeTensorMode` the same mode measures a model that is never allocated: the planner
traces one forward and backward of a micro-batch so (dtrain.planner.traced.profile).

An optional `kind` labels each tensor with one of `kinds` kinds when it is made (for
tensor parallelism: tensors every rank holds whole, tensors a rank holds 1/tp of, tensors
sequence parallelism divides; dtrain.planner.traced.trace); `series` then keeps the bytes of each
kind after every operation, so the peak for any divisor is `max(whole + split / tp ...)`.
`relabel` changes a tensor's kind later (a layer's input, once the layer says what it is).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensors created while the mode is active.

    With `limit` (bytes), an operation that leaves more alive raises MemoryError: a memory
    cap on tensors alone, which the process's address space (threads, the allocator's
    cache) would blur.

    Attributes:
        live: bytes alive after the latest operation.
        peak: the largest `live` seen (reset with `reset_peak`).
        series: the bytes of each kind after every operation, if `kind` was given.
    """

    def __init__(self, kind: Callable[[torch.Tensor], int] | None = None, kinds: int = 2,
                 limit: int | None = None) -> None:
        super().__init__()
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._kind = kind
        self._kinds = kinds if kind is not None else 1
        self.limit = limit
        self.live = self.peak = 0
        self.series: list[tuple[int, ...]] = []

    def watch(self, tensors: object) -> None:
        """Count tensors made before the mode started (a model's parameters, say)."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t)
        self._update()

    def reset_peak(self) -> None:
        self.peak = self.live

    def relabel(self, t: torch.Tensor, kind: int) -> None:
        """Count `t`'s storage (if noted) as `kind` from now on."""
        if t.is_meta:
            return
        key = id(t.untyped_storage())
        known = self._storages.get(key)
        if known is not None and known[0]() is not None and known[1] != kind:
            self._storages[key] = (known[0], kind)
            self._update()

    def _note(self, t: torch.Tensor) -> None:
        if t.is_meta:  # shapes only, no memory (a model built in split form)
            return
        storage = t.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        if known is None or known[0]() is None:
            kind = self._kind(t) if self._kind is not None else 0
            self._storages[key] = (weakref.ref(storage), kind)

    def _update(self) -> None:
        by_kind = [0] * self._kinds
        dead = []
        for key, (ref, kind) in self._storages.items():
            storage = ref()
            if storage is None:
                dead.append(key)
            else:
                by_kind[kind] += storage.nbytes()
        for key in dead:
            del self._storages[key]
        self.live = sum(by_kind)
        self.peak = max(self.peak, self.live)
        if self.limit is not None and self.live > self.limit:
            raise MemoryError(f"live tensors hold {self.live / 2**20:.1f} MiB, over the cap of "
                              f"{self.limit / 2**20:.1f} MiB")
        if self._kind is not None:
            self.series.append(tuple(by_kind))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t)
        self._update()
        return out
