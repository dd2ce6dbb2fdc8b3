"""dtrain: train PyTorch models across many processes, machines and GPUs.

    world = dtrain.init()                 # rank, world_size, local_rank, ... from the launcher
    mesh = dtrain.Mesh(dp=world.world_size)
    model = dtrain.DataParallel(model, group=mesh.group("dp"))
    model = dtrain.ZeRO(model, lambda p: torch.optim.AdamW(p), stage=3)   # or shard it
    dtrain.tensor_parallel.parallelize(model, plan, mesh.group("tp"))     # or split layers

Launch with `dtrain run -n 2 script.py`; `dtrain train` runs the built-in training job.
Names are imported on first use, so the `dtrain` command starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "dtrain.errors",
    "DtrainError": "dtrain.errors",
    "LaunchError": "dtrain.errors",
    "Dims": "dtrain.mesh",
    "LiveAveraging": "dtrain.ft.live",
    "LiveReplicas": "dtrain.ft.live",
    "Mesh": "dtrain.mesh",
    "DataParallel": "dtrain.data_parallel",
    "ShardedSampler": "dtrain.train.sampler",
    "World": "dtrain.world",
    "ZeRO": "dtrain.data_parallel.zero",
    "init": "dtrain.world",
    "shutdown": "dtrain.world",
}
# Every module and subpackage of dtrain, reachable as `dtrain.<name>` on first use.
_SUBPACKAGES = ("adapters", "checkpoint", "comm", "config", "context_parallel", "data",
                "data_parallel", "env", "errors", "faults", "ft", "import_order", "launch",
                "layouts", "masks", "mesh", "models", "pipeline", "planner", "ps", "schema",
                "sizes", "split", "store", "sync", "tensor_parallel", "testing", "timeline",
                "tools", "train", "world")

__all__ = [
    "ConfigError", "DataParallel", "Dims", "DtrainError", "LaunchError", "LiveAveraging",
    "LiveReplicas", "Mesh",
    "ShardedSampler",
    "World", "ZeRO", "init", "shutdown",
]

if TYPE_CHECKING:
    from dtrain.data_parallel import DataParallel
    from dtrain.data_parallel.zero import ZeRO
    from dtrain.errors import ConfigError, DtrainError, LaunchError
    from dtrain.ft.live import LiveAveraging, LiveReplicas
    from dtrain.mesh import Dims, Mesh
    from dtrain.train.sampler import ShardedSampler
    from dtrain.world import World, init, shutdown


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dtrain.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
