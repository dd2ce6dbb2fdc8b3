"""Parameter-server training: each worker trains a whole copy of the model, pushes its gradients to
the servers (dtrain.ps) that hold the model and its optimizer, and pulls the new values.
No collective runs per step, so asynchronous workers never wait on each other."""

from __future__ import annotations

import contextlib
from typing import cast

from torch import nn

from dtrain import comm, env, ps
from dtrain.config import Config
from dtrain.data_parallel.clip import GradPart
from dtrain.layouts.holding import Holding
from dtrain.layouts.parts import Names, Tensors
from dtrain.layouts.state import HeldState, RankExtra
from dtrain.mesh import Mesh
from dtrain.ps.host_snapshots import HostSnapshots


def ps_settings(config: Config) -> ps.Settings:
    """The parameter servers' rules from the config (the optimizer runs on the servers)."""
    o, p = config.optimizer, config.ps
    betas = cast(tuple[float, float], tuple(o.betas))  # two: OptimizerConfig.check
    return ps.Settings(p.consistency, p.staleness if p.consistency == "ssp" else 0,
                       optimizer=o.name, lr=o.lr, momentum=o.momentum, betas=betas,
                       weight_decay=o.weight_decay, copies=p.copies)


class ParameterServer(Holding):
    """A worker's copy of the model; its optimizer is remote (step() pushes and pulls, and carries
    the scheduler's learning rate along)."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: Config,
                 notes: tuple[str, ...] = ()) -> None:
        # Pushes overlap backward unless the gradient must first be clipped whole.
        self.worker = ps.Worker(model, ps_settings(config),
                                overlap=config.optimizer.grad_clip == 0)
        self.dims, self.module, self.names = mesh.dims, model, Names(model)
        self.notes = notes
        self.optimizers = [ps.RemoteOptimizer(self.worker)]
        self.parts = [Tensors(self.names, list(model.parameters()))]
        # The first worker writes its copy of the model alone; the optimizer state lives
        # in the servers' snapshots. Hosts without a shared folder (checkpoint copies,
        # written by every rank together) carry them in their first worker's files.
        world, self._apart = mesh.world, config.checkpoint.copies > 0
        snapshots, servers = env.PS_SNAPSHOT_DIR.get(), config.ps.servers
        here = range(world.node_rank * servers, (world.node_rank + 1) * servers)
        carried: list[RankExtra] = [HostSnapshots(snapshots, here)] \
            if self._apart and snapshots and world.local_rank == 0 else []
        writes_model = world.is_main or not self._apart
        self.saved = HeldState(self.dims, self.optimizers, self.parts if writes_model else [],
                               self.names, checkpoint_group="world" if self._apart else None,
                               writes_checkpoint=self._apart or world.is_main, extras=carried)
        self.groups = {}  # each worker clips its own gradient
        self.lockstep = False  # each worker steps at its own pace
        self.accum = config.train.grad_accum
        pc = config.ps
        copies = f", {pc.copies} copies of each shard" if pc.copies > 1 else ""
        self._how = (f"{pc.consistency} parameter-server training with {pc.servers} "
                     f"server(s) per machine{copies}")

    def grad_parts(self) -> list[GradPart]:
        return [GradPart(p.grad) for p in self.module.parameters() if p.grad is not None]

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.worker.accumulate()

    def update(self) -> None:
        self.optimizers[0].step()

    def zero_grad(self) -> None:
        self.optimizers[0].zero_grad(set_to_none=True)

    def start(self) -> None:
        if self._apart:  # each host's snapshots are back before the servers are seeded
            comm.barrier()
        self.worker.start()  # worker 0 seeds the servers with the (restored) weights

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> str:
        return "; ".join([self.dims.describe(self._how), *self.notes])
