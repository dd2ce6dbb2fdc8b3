"""The servers' optimizer as a worker sees it, so a training loop written for a local
optimizer runs unchanged against parameter servers.

    optimizer = ps.RemoteOptimizer(worker)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)   # works as usual
    loss.backward(); optimizer.step(); optimizer.zero_grad(); scheduler.step()

`step()` is the worker's push-then-pull; the learning rate a scheduler sets on this object
travels with every push, and the servers apply it to their own optimizer.
"""

from __future__ import annotations

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

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: D102 - torch's signature
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.worker.step()
