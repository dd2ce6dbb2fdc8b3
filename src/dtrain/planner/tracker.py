"""Live tensor bytes, measured op by op: the peak memory of real runs and of traced ones.

`LiveBytes` is a dispatch mode: every tensor an operation returns has its storage noted
(once, weakly), and after every operation the bytes of all noted storages still alive are
summed. Storages resized in place (ZeRO-3 frees gathered parameters so) are counted at
their current size. On CUDA, `torch.cuda.max_memory_allocated` gives the same figure; on
the CPU there is no allocator statistic, and this is the equivalent: bytes of live tensors,
not the process's resident memory (the Python interpreter, libraries and the allocator's
cache are left out).

Under `FakeTensorMode` the same mode measures a model that is never allocated: the planner
traces one forward and backward of a micro-batch so (dtrain.planner.profile).

An optional `split` test divides the bytes in two kinds (for tensor parallelism: tensors
a rank holds only 1/tp of); `series` then keeps (other, split) after every operation, so
the peak for any divisor is `max(other + split / tp)`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensors created while the mode is active.

    Attributes:
        live: bytes alive after the latest operation.
        peak: the largest `live` seen (reset with `reset_peak`).
        series: (other bytes, split bytes) after every operation, if `split` was given.
    """

    def __init__(self, split: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self._storages: dict[int, tuple[weakref.ref, bool]] = {}
        self._split = split
        self.live = self.peak = 0
        self.series: list[tuple[int, int]] = []

    def watch(self, tensors: Any) -> None:
        """Count tensors made before the mode started (a model's parameters, say)."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t)
        self._update()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _note(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        if known is None or known[0]() is None:
            split = self._split is not None and self._split(t)
            self._storages[key] = (weakref.ref(storage), split)

    def _update(self) -> None:
        other = split = 0
        dead = []
        for key, (ref, is_split) in self._storages.items():
            storage = ref()
            if storage is None:
                dead.append(key)
            elif is_split:
                split += storage.nbytes()
            else:
                other += storage.nbytes()
        for key in dead:
            del self._storages[key]
        self.live = other + split
        self.peak = max(self.peak, self.live)
        if self._split is not None:
            self.series.append((other, split))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t)
        self._update()
        return out
