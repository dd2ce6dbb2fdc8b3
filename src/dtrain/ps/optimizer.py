"""The servers' optimizer as a worker sees it, so a training loop written for a local
optimizer runs unchanged against parameter servers.

    optimizer = ps.RemoteOptimizer(worker)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)   # works as usual
    loss.backward(); optimizer.step(); optimizer.zero_grad(); scheduler.step()

`step()` is the worker's push-then-pull; the learning rate a scheduler sets on this object
travels with every push, and the servers apply it to their own optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch

from dtrain.ps.worker import Worker


class RemoteOptimizer(torch.optim.Optimizer):
    """A torch Optimizer whose state and update live on the parameter servers.

    Args:
        worker: the started (or about to start) worker whose model this updates.
    """

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker.params, {"lr": worker.settings.lr})
        self.worker = worker
        worker.lr_of = lambda: self.param_groups[0]["lr"]

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """The worker's push-then-pull; `closure`, when given, first recomputes the loss,
        which is returned, as torch's optimizers return it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.worker.step()
        return loss
