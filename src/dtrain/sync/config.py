"""The `[sync]` section: how often the sync groups meet, and what slow links allow.

    [sync]  method = "diloco", every = 50, outer_lr = 0.7   # default: every_step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.comm.config import CommConfig
from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig
from dtrain.schema import non_negative, positive


@dataclass
class SyncConfig:
    """How often the copies of the model meet: every step, or every few steps over slow
    links (local SGD, DiLoCo), each copy a sync group of ranks."""

    method: Literal["every_step", "local_sgd", "diloco"] = "every_step"
    """every_step (gradients averaged each step), local_sgd (the sync groups train alone
    and average their parameters every `every` steps) or diloco (the groups' mean change
    drives an outer Nesterov step every `every` steps; Douillard et al., 2023)."""
    groups: int = non_negative(0)
    """With method = local_sgd or diloco: sync groups of dp x cp x tp x pp consecutive
    ranks each (dp: data parallelism or ZeRO inside a group, every step); 0: ranks / (cp x
    tp x pp), so that each group is one cp x tp x pp block (dp = 1)."""
    every: int = positive(50)
    """With method = local_sgd or diloco: inner steps between synchronizations (H)."""
    outer_lr: float = positive(0.7)
    """With method = diloco: the outer optimizer's learning rate."""
    outer_momentum: float = 0.9
    """With method = diloco: the outer optimizer's Nesterov momentum, in [0, 1)."""
    streaming: bool = False
    """With method = local_sgd or diloco: the synchronization's all-reduce overlaps the
    next inner step, its result applied one step late."""

    def check(self) -> None:
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"sync.outer_momentum = {self.outer_momentum} must be in [0, 1)")

    @property
    def groups_asked(self) -> int | None:
        """What the job's Dims take as its sync groups (dtrain.mesh.dims.Dims.of): None
        when gradients meet every step, else `groups` (0: one per cp x tp x pp block)."""
        return None if self.method == "every_step" else self.groups


def check_config(sync: SyncConfig, comm: CommConfig, parallel: ParallelConfig,
                 live: bool) -> None:
    """Gradient compression and infrequent synchronization: what they work with (`live`:
    the job runs live replicas).

    Raises:
        ConfigError: a combination they do not support, in one line.
    """
    if comm.compression != "none":
        what = f"comm.compression = {comm.compression!r}"
        if parallel.exchange == "ps":
            raise ConfigError(f"{what} compresses DataParallel's all-reduce; parameter servers "
                              "send whole gradients: use comm.compression = \"none\" with "
                              "parallel.exchange = \"ps\"")
        if parallel.zero:
            raise ConfigError(f"{what} compresses DataParallel's all-reduce, not ZeRO's "
                              "reduce-scatter: use parallel.zero = 0, or comm.compression = "
                              "\"none\"")
        if comm.grad_dtype != "fp32":
            raise ConfigError(f"{what} replaces comm.grad_dtype = {comm.grad_dtype!r}: leave "
                              "comm.grad_dtype = \"fp32\"")
        if live:
            raise ConfigError(f"{what} with fault_tolerance.mode = \"live\": a live replica's "
                              "error feedback cannot be sent to its replacement; use one of "
                              "them")
        if parallel.ep > 1:
            raise ConfigError("parallel.ep > 1 with comm.compression is not supported yet: leave "
                              "parallel.ep = 1, or comm.compression = \"none\"")
    if sync.method != "every_step":
        what = f"sync.method = {sync.method!r}"
        if parallel.exchange == "ps" or live:
            raise ConfigError(f"{what} synchronizes the sync groups of a collective job: use "
                              "parallel.exchange = \"collective\" and fault_tolerance.mode = "
                              "\"restart\"")
        if comm.compression != "none":
            raise ConfigError(f"{what} already sends parameters every sync.every steps only: "
                              "leave comm.compression = \"none\"")
