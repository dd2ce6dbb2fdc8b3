"""The planner's check: the peak memory of a real run of dtrain's GPT (or another built-in
model, given its resolved `[model]` section) in a layout.

`measured_peaks` builds the model the way `dtrain train` does: a skeleton on the meta
device (dtrain.models.init) that `dtrain.layouts.build` splits over tp (with sequence
parallelism if asked), marks for recomputation as `[memory]` says, cuts into pipeline
pieces and wraps over dp in DataParallel or ZeRO, allocating only what this rank holds
and drawing its initial values. It then trains a few steps on random tokens with AdamW
and returns this rank's peaks of live tensor bytes (dtrain.planner.traced.tracker; on CUDA
`max_memory_allocated` would read the same): while building, and in the steady state.
A mixture of experts' layout may split the experts over ep (carved from dp: the mesh's "ep"
and "edp" groups); a context-parallel one feeds each rank its chunks of every sequence, as
the trainer does, and attends by the given cp method. Call it on every rank of an
initialized world of `dp * cp * tp * pp` ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dtrain import comm, layouts, models
from dtrain.config import Config, config_from_dict, dims_of
from dtrain.context_parallel import chunks
from dtrain.mesh import Dims, Mesh
from dtrain.models import init
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPTConfig
from dtrain.planner.planned import parallel_section
from dtrain.planner.traced.profile import model_config
from dtrain.planner.traced.tracker import LiveBytes

CALIBRATED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class Peaks:
    """A rank's peaks of live tensor bytes (see the module doc)."""

    build: int  # while dtrain.layouts.build makes its share of the model
    train: int  # over the training steps after the first


def run_config(cfg: GPTConfig | ModelConfig, layout: Dims, batch: int,
               bucket_mb: float = 25.0, recompute: str = "none",
               sequence_parallel: bool = False, cp_method: str = "ring") -> Config:
    """The `dtrain train` config of `cfg` in `layout` with a global batch of `batch`
    sequences, AdamW, `[memory] recompute = recompute`.

    Raises:
        ConfigError: the options do not go together (sequence parallelism without tp).
    """
    return config_from_dict({
        "model": dataclasses.asdict(model_config(cfg)),
        "optimizer": {"name": "adamw"},
        "train": {"batch_size": batch, "seed": 0},
        "parallel": {**parallel_section(layout), "nproc": layout.world_size,
                     "cp_method": cp_method, "sequence_parallel": sequence_parallel},
        "comm": {"bucket_mb": bucket_mb},
        "memory": {"recompute": recompute},
    })


def calibrate(mesh: Mesh) -> None:
    """Let `algorithm="auto"` time its candidates on every group of `mesh` now (probe
    tensors of up to 16 MiB), so that no measured peak sees them. A collective call."""
    for axis in ("pp", "dp", "tp", "edp", "cp"):
        group = mesh.group(axis)
        if comm.resolve(group).size > 1:
            for op in CALIBRATED_OPS:
                comm.explain(op, 1 << 20, group)


def measured_peaks(cfg: GPTConfig | ModelConfig, layout: Dims, batch: int, steps: int = 3,
                   bucket_mb: float = 25.0, recompute: str = "none",
                   sequence_parallel: bool = False, cp_method: str = "ring") -> Peaks:
    """This rank's peak live tensor bytes while building `cfg`'s model in `layout` from a
    skeleton, and over steps 2..`steps` of a `batch`-sequence global batch (the steady
    state, with optimizer state; the first step builds that state)."""
    config = run_config(cfg, layout, batch, bucket_mb, recompute, sequence_parallel,
                        cp_method)
    mesh = Mesh(dims_of(config, layout.world_size))
    calibrate(mesh)
    shape = config.model
    tracker = LiveBytes()
    with tracker:
        model = init.skeleton(lambda: models.build(shape))
        held = layouts.build(model, mesh, config)
        build = tracker.peak
        generator = torch.Generator().manual_seed(mesh.coords["dp"])
        per_rank = batch // layout.dp
        for step in range(steps):
            if step == 1:
                tracker.reset_peak()
            x = torch.randint(0, shape.vocab_size, (per_rank, shape.block_size),
                              generator=generator)
            x = chunks.shard(x, mesh.coords["cp"], mesh.size("cp"))  # as the trainer feeds
            held.forward_backward([(x, x)])
            held.step()
            held.zero_grad()
    return Peaks(build, tracker.peak)


def measured_peak(cfg: GPTConfig | ModelConfig, layout: Dims, batch: int, steps: int = 3,
                  bucket_mb: float = 25.0, recompute: str = "none",
                  sequence_parallel: bool = False, cp_method: str = "ring") -> int:
    """This rank's steady-state peak live tensor bytes (`measured_peaks(...).train`)."""
    return measured_peaks(cfg, layout, batch, steps, bucket_mb, recompute,
                          sequence_parallel, cp_method).train
