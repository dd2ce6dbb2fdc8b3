"""Gradients finished at the end of backward, before data parallelism reads them.

Some gradients are not whole when autograd accumulates them. Under sequence parallelism a
norm's weight gets the contribution of this rank's part of the sequence only; the sum over
the tensor-parallel group is done once for all such parameters, one all-reduce at the end
of backward (dtrain.tensor_parallel.sequence), where a hook per parameter would make one
call each. A strategy reading `.grad` while backward goes (DataParallel's and ZeRO's
gradient hooks) must then wait for them:

    in its hook             finisher = late_grads.late(param); if one, put param aside
    at the end of backward  finisher.finish(), then read what was put aside

A finisher finishes once per backward; whoever calls it first (a strategy's
end-of-backward callback, or the finisher's own) does the work, on every rank in the same
order, so collectives line up.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch


class Finisher(Protocol):
    """What completes some parameters' gradients at the end of backward."""

    def pending(self, param: torch.Tensor) -> bool:
        """Whether this backward gave `param` a gradient not finished yet."""
        ...

    def finish(self) -> None:
        """Finish every pending gradient (each backward's once; later calls do nothing)."""
        ...


_finishers: weakref.WeakValueDictionary[int, Finisher] = weakref.WeakValueDictionary()
_owned: dict[int, weakref.ref] = {}  # id(param) -> the parameter, to tell a reused id


def finish_later(param: torch.Tensor, finisher: Finisher) -> None:
    """Register `finisher` as finishing `param`'s gradient at the end of each backward."""
    _finishers[id(param)] = finisher
    _owned[id(param)] = weakref.ref(param)


def late(param: torch.Tensor) -> Finisher | None:
    """The finisher `param`'s gradient of this backward waits for, or None (whole already)."""
    finisher = _finishers.get(id(param))
    owner = _owned.get(id(param))
    if finisher is None or owner is None or owner() is not param:
        return None
    return finisher if finisher.pending(param) else None
