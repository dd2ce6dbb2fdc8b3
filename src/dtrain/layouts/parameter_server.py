"""Parameter-server training: each worker trains a whole replica, pushes its gradients to
the servers (dtrain.ps) that hold the model and its optimizer, and pulls the new values.
No collective runs per step, so asynchronous workers never wait on each other."""

from __future__ import annotations

import contextlib

from torch import nn

from dtrain import ps
from dtrain.config import Config
from dtrain.job_layout import Layout
from dtrain.layouts.held import Names, Tensors
from dtrain.layouts.holding import Holding
from dtrain.mesh import Mesh
from dtrain.parallel.clip import GradPart


def ps_settings(config: Config) -> ps.Settings:
    """The parameter servers' rules from the config (the optimizer runs on the servers)."""
    o, p = config.optimizer, config.ps
    return ps.Settings(p.consistency, p.staleness if p.consistency == "ssp" else 0,
                       optimizer=o.name, lr=o.lr, momentum=o.momentum, betas=tuple(o.betas),
                       weight_decay=o.weight_decay, replicas=p.replicas)


class ParameterServer(Holding):
    """A worker's replica; its optimizer is remote (step() pushes and pulls, and carries
    the scheduler's learning rate along)."""

    # The first worker writes its replica alone; the optimizer state lives in the
    # servers' snapshots.
    checkpoint_group = None

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, config: Config,
                 notes: tuple[str, ...] = ()) -> None:
        # Pushes overlap backward unless the gradient must first be clipped whole.
        self.worker = ps.Worker(model, ps_settings(config),
                                overlap=config.optimizer.grad_clip == 0)
        self.layout, self.module, self.names = layout, model, Names(model)
        self.notes = notes
        self.optimizers = [ps.RemoteOptimizer(self.worker)]
        self.held = [Tensors(self.names, list(model.parameters()))]
        self.groups = {}  # each worker clips its own gradient
        self.accum = config.train.grad_accum
        self.writes_checkpoint = mesh.world.is_main
        pc = config.ps
        copies = f", {pc.replicas} copies of each shard" if pc.replicas > 1 else ""
        self._how = (f"{pc.consistency} parameter-server training with {pc.servers} "
                     f"server(s) per machine{copies}")

    def grad_parts(self) -> list[GradPart]:
        return [GradPart(p.grad) for p in self.module.parameters() if p.grad is not None]

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.worker.accumulate()

    def step(self) -> None:
        self.optimizers[0].step()

    def zero_grad(self) -> None:
        self.optimizers[0].zero_grad(set_to_none=True)

    def start(self) -> None:
        self.worker.start()  # worker 0 seeds the servers with the (restored) weights

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> str:
        return "; ".join([self.layout.describe(self._how), *self.notes])
